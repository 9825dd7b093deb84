"""train's Hydra app: presets and config groups, every experiment config trains, the head learns and
round-trips, early stopping keeps the best epoch, per-epoch remixing, validation held out of a
train-only dataset, joined datasets, the learning-rate schedule, a real data_gen output, the
command line. Also here: tests/apps/train/test_{feature_cache,resume,train_inputs}.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdecpp.stopping.head import AcceptanceHead
from specdecpp.training.mixing import mixed_features, mixing_mask
from tests.helpers.paths import CONF, REPO
from tests.helpers.train import base_overrides, head_module, random_rows, save_dataset, train_cfg
from train import run
from train.checks import load_dataset_dir
from train.data import HeadDataConfig, HeadDataModule
from train.module import AcceptanceHeadModule


# -- the Hydra app --------------------------------------------------------------------------------
def sweep_jobs(pattern: str) -> list[list[str]]:
    """The jobs `python -m train -m '+experiment=glob(...)'` launches (Hydra's basic sweeper)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        overrides = parser.parse_overrides([f"+experiment=glob({pattern})", "trainer=smoke"])
        return BasicSweeper.split_arguments(overrides, max_batch_size=None)[0]


def test_small_data_preset_combines_with_a_head():
    cfg = train_cfg(["+experiment=[wrej6_d3,small_data]"])
    assert (cfg.experiment_name, cfg.head.depth, cfg.loss.w_rej) == ("wrej6_d3", 3, 6)
    assert (cfg.optimizer.lr, cfg.trainer.max_epochs, cfg.data.batch_size) == (3e-3, 30, 8)
    assert cfg.callbacks.early_stopping.monitor == "val/loss" and "checkpoint" in cfg.callbacks


def test_module_and_datamodule_are_instantiated_from_their_config_groups():
    """conf/model and conf/datamodule name the Lightning classes; their settings follow the public
    keys (an experiment's loss.w_rej, data.batch_size, optimizer.lr) by interpolation."""
    from functools import partial

    from hydra.utils import instantiate

    cfg = train_cfg(["+experiment=[wrej12_d1,small_data]", "data.mix_ratio=0.2", "seed=4"])
    model = instantiate(cfg.model)
    assert isinstance(model, partial) and model.func is AcceptanceHeadModule
    assert (model.keywords["w_rej"], model.keywords["w_acc"], model.keywords["mix_ratio"],
            model.keywords["mix_seed"]) == (12, 1, 0.2, 4)
    optimizer = model.keywords["optimizer"](params=[torch.zeros(1, requires_grad=True)])
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 3e-3
    module = model(head=AcceptanceHead(32, 1))
    assert (module.hparams.w_rej, module.hparams.warmup_ratio, module.hparams.remix_each_epoch) == (12, 0.03, False)
    data = instantiate(cfg.datamodule)
    assert data.func is HeadDataModule
    # the datamodule's settings: one HeadDataConfig, built from data.*, seed and the pair's precision
    settings = HeadDataConfig.from_cfg(cfg, val_split="dev")
    assert (settings.batch_size, settings.seed, settings.mix_seed, settings.mix_ratio, settings.train_split,
            settings.val_split) == (8, 4, 4, 0.2, "train", "dev")
    assert (settings.cache_features, settings.cache_dtype, settings.feature_batch_size, settings.num_workers) == (
        cfg.data.cache_features, cfg.data.cache_dtype, cfg.data.feature_batch_size, cfg.data.num_workers)
    bf16 = train_cfg(["+experiment=wrej12_d1", "pair.device=cpu", "pair.dtype=bfloat16"])
    assert HeadDataConfig.from_cfg(bf16, val_split=None).draft_precision == "bfloat16"


def test_every_experiment_config_runs(tiny_dataset, tiny_pair, tmp_path):
    """The glob sweep expands to the paper's 20 heads; each composes and trains a few steps."""
    jobs = sweep_jobs("wrej*")
    names = sorted(job[0].split("=")[1] for job in jobs)
    assert names == sorted(f"wrej{w}_d{d}" for w in (1, 3, 6, 12) for d in range(5))
    for job in jobs:
        name = job[0].split("=")[1]
        out = tmp_path / name
        cfg = train_cfg([*job, *base_overrides(tiny_pair, tiny_dataset, tmp_path, "callbacks=none"), f"out={out}"])
        assert cfg.experiment_name == name
        result = run(cfg)
        head = AcceptanceHead.from_pretrained(out)
        w, d = name[4:].split("_d")
        assert (head.depth, head.meta["training"]["w_rej"], head.meta["training"]["w_acc"]) == (int(d), float(w), 1.0)
        assert result["global_step"] == 2
        assert set(head.meta["metrics"]) == {"train", "dev", "test"}


def learnable_dataset(directory: Path, tiny_pair, draft, mix_seed: int) -> Path:
    """Labels P_i = sigmoid(w . e_i) of the draft's own features under the fixed mixing: a linear
    head can learn them exactly; a constant cannot."""
    splits = {"train": random_rows(48, tiny_pair.vocab, 11), "dev": random_rows(16, tiny_pair.vocab, 12)}
    w = torch.randn(32, generator=torch.Generator().manual_seed(5))
    for rows in splits.values():
        batch = [{"row": j, "prompt_ids": torch.tensor(rows["prompt_ids"][j]),
                  "target_ids": torch.tensor(rows["target_ids"][j]), "draft_ids": torch.tensor(rows["draft_ids"][j]),
                  "p_acc": torch.tensor(rows["p_acc"][j])} for j in range(len(rows["id"]))]
        hidden, _ = mixed_features(draft, batch, 0.15, mix_seed, 0)
        scale = 2.5 / torch.cat(hidden).matmul(w).std()
        for j, h in enumerate(hidden):
            keep = (~mixing_mask(len(rows["target_ids"][j]), 0.15, mix_seed, 0, j)).nonzero().squeeze(-1)
            labels = torch.tensor(rows["p_acc"][j])
            labels[keep] = torch.sigmoid(scale * h.matmul(w))
            rows["p_acc"][j] = labels.tolist()
    return save_dataset(directory, splits, tiny_pair.draft, 32, tiny_pair.vocab)


def test_head_learns_labels_that_depend_on_the_hidden_state_and_round_trips(tiny_pair, draft, tmp_path):
    data = learnable_dataset(tmp_path / "data", tiny_pair, draft, mix_seed=0)
    cfg = train_cfg([*base_overrides(tiny_pair, data, tmp_path, "callbacks=none", "trainer=cpu"),
                     "+experiment=wrej1_d0", "trainer.max_epochs=25", "data.batch_size=8", "optimizer.lr=0.05"])
    result = run(cfg)
    for split in ("train", "dev"):
        metrics = result["metrics"][split]
        assert metrics["KL"] < 0.05 * metrics["KL_const"], metrics
        assert metrics["AUROC"] > 0.85
    # save/load round trip: the saved head is the trained head, its config says how it was made
    out = Path(cfg.out)
    loaded = AcceptanceHead.from_pretrained(out)
    x = torch.randn(10, 32)
    torch.testing.assert_close(loaded(x), result["module"].head.cpu()(x))
    config = json.loads((out / "config.json").read_text())
    assert ((config["draft"], config["depth"], config["hidden_size"], config["target"])
            == (tiny_pair.draft, 0, 32, "tiny-target"))
    training = config["training"]
    assert (training["dataset"], training["w_rej"], training["w_acc"], training["mix_ratio"], training["seed"]) == \
        (str(data), 1.0, 1.0, 0.15, 0)
    assert config["metrics"]["dev"]["KL"] == pytest.approx(result["metrics"]["dev"]["KL"])
    assert training["global_step"] == 25 * 6
    assert (out / "calibration.png").stat().st_size > 10_000
    loaded.check_draft(draft)


def test_early_stopping_saves_the_best_epochs_weights_not_the_last(tiny_pair, draft, tmp_path, monkeypatch):
    """Dev labels opposite to the train labels: the dev loss rises as the head learns, early
    stopping ends the run; the saved head is the epoch with the lowest val/loss (as logged)."""
    import csv

    data = learnable_dataset(tmp_path / "data", tiny_pair, draft, mix_seed=0)
    dev = data / "dev"
    from datasets import load_from_disk
    rows = load_from_disk(str(dev)).to_dict()
    rows["p_acc"] = [[1.0 - v for v in r] for r in rows["p_acc"]]
    splits = {"train": load_from_disk(str(data / "train")).to_dict(), "dev": rows}
    data = save_dataset(tmp_path / "flipped", splits, tiny_pair.draft, 32, tiny_pair.vocab)

    snapshots = {}
    real_end = AcceptanceHeadModule.on_validation_epoch_end

    def snapshot(self):
        real_end(self)
        snapshots[self.current_epoch] = {k: v.clone() for k, v in self.head.state_dict().items()}

    monkeypatch.setattr(AcceptanceHeadModule, "on_validation_epoch_end", snapshot)
    cfg = train_cfg([*base_overrides(tiny_pair, data, tmp_path, "trainer=cpu", "logger=csv"),
                     "+experiment=[wrej1_d0,small_data]", "trainer.max_epochs=12", "optimizer.lr=0.05",
                     "~callbacks.progress_bar", "~callbacks.checkpoint"])
    result = run(cfg)
    with open(next(Path(cfg.out).rglob("metrics.csv"))) as f:
        logged = [(int(r["epoch"]), float(r["val/loss"])) for r in csv.DictReader(f) if r.get("val/loss")]
    best_epoch = min(logged, key=lambda e: e[1])[0]
    last_epoch = logged[-1][0]
    assert last_epoch == best_epoch + 3 < 11  # patience 3 stopped it early
    training = AcceptanceHead.from_pretrained(cfg.out).meta["training"]
    assert (training["weights"], training["best_epoch"]) == ("best_val", best_epoch)
    assert training["val_loss_per_epoch"] == pytest.approx([v for _, v in logged], rel=1e-5)
    saved = AcceptanceHead.from_pretrained(cfg.out).state_dict()
    torch.testing.assert_close(saved, snapshots[best_epoch])
    assert not torch.allclose(saved["out.weight"], snapshots[last_epoch]["out.weight"])
    torch.testing.assert_close(result["module"].head.cpu().state_dict(), saved)  # evaluated with these weights
    last = run(train_cfg([*base_overrides(tiny_pair, data, tmp_path / "last", "trainer=cpu", "logger=none"),
                          "+experiment=[wrej1_d0,small_data]", "trainer.max_epochs=12", "optimizer.lr=0.05",
                          "~callbacks.progress_bar", "~callbacks.checkpoint", "weights=last"]))
    assert AcceptanceHead.from_pretrained(last["out"]).meta["training"]["weights"] == "last"
    torch.testing.assert_close(AcceptanceHead.from_pretrained(last["out"]).state_dict(), snapshots[last_epoch])


def test_remix_each_epoch_draws_a_new_mixing_per_epoch_and_validates_on_the_fixed_one(
        tiny_dataset, tiny_pair, tmp_path, monkeypatch):
    import train.module

    epochs = []
    real = train.module.mixed_features

    def recording(draft_model, rows, ratio, seed, epoch, spec=None):
        epochs.append((torch.is_grad_enabled(), epoch))
        return real(draft_model, rows, ratio, seed, epoch, spec)

    monkeypatch.setattr(train.module, "mixed_features", recording)
    cfg = train_cfg([*base_overrides(tiny_pair, tiny_dataset, tmp_path, "trainer=smoke", "callbacks=none"),
                     "data.cache_features=false", "data.remix_each_epoch=true", "trainer.max_epochs=3",
                     "trainer.limit_train_batches=1", "trainer.limit_test_batches=0"])
    run(cfg)
    assert epochs == [(True, 0), (False, 0), (True, 1), (False, 0), (True, 2), (False, 0)]  # train, validate


def test_draft_comes_from_the_dataset_and_a_train_only_dataset_holds_out_validation(tiny_pair, tmp_path):
    """`python -m train +experiment=wrej6_d3 data.path=DIR`: no pair.*, no dev split."""
    data = save_dataset(tmp_path / "data", {"train": random_rows(30, tiny_pair.vocab, 4)}, tiny_pair.draft, 32,
                        tiny_pair.vocab)

    def train(out, *extra):
        return run(train_cfg(["+experiment=wrej6_d3", f"data.path={data}", f"out={tmp_path / out}", "logger=none",
                              "trainer=smoke", "callbacks=none", f"data.cache_dir={tmp_path / 'cache'}", *extra]))

    first = train("a")
    head = AcceptanceHead.from_pretrained(tmp_path / "a")
    assert head.draft == tiny_pair.draft
    validation = head.meta["training"]["validation"]
    assert (validation["held_out_from"], validation["fraction"], validation["seed"], validation["rows"]) == \
        ("train", 0.1, 0, 3)
    assert set(first["metrics"]) == {"train", "val"}
    lengths = {f"4-{j}": len(x) for j, x in enumerate(random_rows(30, tiny_pair.vocab, 4)["target_ids"])}
    held = validation["ids"]
    kept = [i for i in lengths if i not in held]
    for split, ids in (("val", held), ("train", kept)):  # each slice holds exactly its own prompts
        assert first["metrics"][split]["positions"] == sum(
            int((~mixing_mask(lengths[i], 0.15, 0, 0, k)).sum()) for k, i in enumerate(ids)), split
    assert json.loads((tmp_path / "a" / "validation_ids.json").read_text()) == validation["ids"]
    assert set(validation["ids"]) <= {f"4-{j}" for j in range(30)}
    assert AcceptanceHead.from_pretrained(Path(train("b")["out"])).meta["training"]["validation"]["ids"] == \
        validation["ids"]  # seeded
    other = AcceptanceHead.from_pretrained(Path(train("c", "data.val_seed=1")["out"])).meta["training"]["validation"]
    assert other["ids"] != validation["ids"] and other["seed"] == 1
    with pytest.raises(ValueError, match="does not match the configured draft"):  # an explicit draft still wins
        train("d", f"pair.draft={tiny_pair.target}")


def test_joined_datasets_train_as_one(tiny_pair, tmp_path):
    """data.path=[A,B]: every split the rows of A then B (e.g. one pair's prompts labelled again with
    another data_gen seed), the head trained on all of them and recording both sources."""
    vocab = tiny_pair.vocab
    a_rows, b_rows, dev_rows = random_rows(10, vocab, 5), random_rows(14, vocab, 6), random_rows(6, vocab, 7)
    a = save_dataset(tmp_path / "a", {"train": a_rows, "dev": dev_rows}, tiny_pair.draft, 32, vocab)
    b = save_dataset(tmp_path / "b", {"train": b_rows}, tiny_pair.draft, 32, vocab)
    splits, meta = load_dataset_dir([str(a), str(b)])
    assert splits["train"]["id"] == a_rows["id"] + b_rows["id"]
    assert splits["train"]["p_acc"] == [list(map(float, np.float32(x))) for x in a_rows["p_acc"] + b_rows["p_acc"]]
    assert splits["dev"]["id"] == dev_rows["id"] and meta["rows"] == {"train": 24, "dev": 6}
    assert [j["path"] for j in meta["joined"]] == [str(a), str(b)] and meta["draft"] == tiny_pair.draft
    full = ["trainer=smoke", "callbacks=none", "trainer.limit_test_batches=null"]  # evaluate every train row
    out = run(train_cfg([*base_overrides(tiny_pair, a, tmp_path), f"data.path=[{a},{b}]", *full]))
    alone = run(train_cfg([*base_overrides(tiny_pair, a, tmp_path / "alone"), *full]))
    labelled = sum(len(x) for x in a_rows["target_ids"] + b_rows["target_ids"])
    assert alone["metrics"]["train"]["positions"] < out["metrics"]["train"]["positions"] <= labelled
    head = AcceptanceHead.from_pretrained(Path(out["out"]))
    assert [j["path"] for j in head.meta["training"]["dataset_meta"]["joined"]] == [str(a), str(b)]


def test_learning_rate_schedule_is_warmup_then_cosine(draft):
    from types import SimpleNamespace

    from transformers import get_cosine_schedule_with_warmup

    module = head_module(draft)
    module._trainer = SimpleNamespace(estimated_stepping_batches=100)
    reference = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=1.0), 3, 100).lr_lambdas[0]
    assert [module.lr_factor(s) for s in range(101)] == pytest.approx([reference(s) for s in range(101)])


@pytest.mark.slow
def test_command_line(tiny_dataset, tiny_pair, tmp_path):
    """`python -m train +experiment=wrej6_d3 data.path=DIR out=DIR` as written in the docs (no pair.*: the
    draft comes from the dataset's meta)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "cli_head"
    command = [sys.executable, "-m", "train", "+experiment=wrej6_d3", f"data.path={tiny_dataset}", f"out={out}",
               "trainer=smoke", "logger=csv", f"data.cache_dir={tmp_path / 'cache'}",
               f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    head = AcceptanceHead.from_pretrained(out)
    assert (head.depth, head.meta["training"]["w_rej"], head.draft) == (3, 6.0, tiny_pair.draft)
    assert (out / "logs" / "csv").is_dir() and (out / "ckpt" / "last.ckpt").is_file()


