"""The train app in tests: synthetic datasets in the data_gen format, train's Hydra config
composed from overrides, and a Lightning module around a fresh head."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, DatasetDict
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdecpp.data.dataset import FEATURES
from specdecpp.stopping.head import AcceptanceHead
from tests.helpers.paths import CONF
from train.module import AcceptanceHeadModule

COLUMNS = ("id", "prompt", "prompt_ids", "target_ids", "draft_ids", "p_acc", "draft_entropy")


# -- synthetic datasets in the data_gen format ---------------------------------------------------
def random_rows(n: int, vocab: int, seed: int, max_len: int = 12) -> dict:
    """Rows with the DESIGN.md columns: random prompts and responses, draft tokens agreeing with
    the target 60% of the time (label 1 there), other labels uniform."""
    rng = np.random.default_rng(seed)
    rows = {c: [] for c in COLUMNS}
    for j in range(n):
        length = int(rng.integers(4, max_len + 1))
        x = rng.integers(3, vocab, length)
        y = np.where(rng.random(length) < 0.6, x, rng.integers(3, vocab, length))
        rows["id"].append(f"{seed}-{j}")
        rows["prompt"].append(f"prompt {j}")
        rows["prompt_ids"].append(rng.integers(3, vocab, int(rng.integers(3, 7))).tolist())
        rows["target_ids"].append(x.tolist())
        rows["draft_ids"].append(y.tolist())
        rows["p_acc"].append(np.where(x == y, 1.0, rng.random(length)).astype(np.float32).tolist())
        rows["draft_entropy"].append(rng.random(length).astype(np.float32).tolist())
    return rows


def save_dataset(directory: Path, splits: dict[str, dict], draft: str, hidden: int, vocab: int) -> Path:
    DatasetDict({name: Dataset.from_dict(rows, features=FEATURES) for name, rows in splits.items()}
                ).save_to_disk(str(directory))
    meta = {"complete": True, "draft": draft, "target": "tiny-target", "draft_hidden_size": hidden, "vocab_size": vocab,
            "sampling": {"temperature": 1.0, "top_k": 50, "top_p": 1.0}, "seed": 0,
            "prompts": {"source": "synthetic", "split": "train"}, "max_new_tokens": 12,
            "code_version": "test", "created": "2026-01-01T00:00:00"}
    (directory / "specdecpp_meta.json").write_text(json.dumps(meta))
    return directory


def train_cfg(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides)


def base_overrides(tiny_pair, data: Path, tmp: Path, *extra: str) -> list[str]:
    return [f"pair.draft={tiny_pair.draft}", "pair.target=unused", "pair.device=cpu", f"data.path={data}",
            f"data.cache_dir={tmp / 'cache'}", f"out={tmp / 'head'}", "logger=none", "data.batch_size=4", *extra]


def head_module(draft, remix: bool = False, depth: int = 2) -> AcceptanceHeadModule:
    torch.manual_seed(0)
    return AcceptanceHeadModule(AcceptanceHead(32, depth), optimizer=torch.optim.Adam, w_rej=6.0,
                                mix_ratio=0.15, mix_seed=7, remix_each_epoch=remix, draft=draft)
