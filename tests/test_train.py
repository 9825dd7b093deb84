"""train: token mixing, weighted BCE, metrics, feature cache, the Hydra app, resume, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdecpp.head import AcceptanceHead
from specdecpp.mixing import (binary_entropy, binary_kl, calibration_bins, draft_features,
                              expected_calibration_error, mixed_example, mixed_features, mixing_mask,
                              rejection_auroc, weighted_bce)
from specdecpp.models import load_model
from train import run
from train.cache import feature_cache
from train.checks import check_draft_matches
from train.data import HeadDataModule
from train.metrics import RejectionAUROC, SoftCalibrationError
from train.module import AcceptanceHeadModule

CONF = Path(__file__).resolve().parents[1] / "conf"
COLUMNS = ("id", "prompt", "prompt_ids", "target_ids", "draft_ids", "p_acc", "draft_entropy")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine run far faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    DatasetDict({name: Dataset.from_dict(rows) for name, rows in splits.items()}).save_to_disk(str(directory))
    meta = {"draft": draft, "target": "tiny-target", "draft_hidden_size": hidden, "vocab_size": vocab,
            "sampling": {"temperature": 1.0, "top_k": 50, "top_p": 1.0}, "seed": 0,
            "prompts": {"source": "synthetic", "split": "train"}, "max_new_tokens": 12,
            "code_version": "test", "created": "2026-01-01T00:00:00"}
    (directory / "specdecpp_meta.json").write_text(json.dumps(meta))
    return directory


@pytest.fixture(scope="module")
def tiny_dataset(tiny_pair, tmp_path_factory):
    splits = {"train": random_rows(24, tiny_pair.vocab, 1), "dev": random_rows(8, tiny_pair.vocab, 2),
              "test": random_rows(8, tiny_pair.vocab, 3)}
    return save_dataset(tmp_path_factory.mktemp("tiny_data"), splits, tiny_pair.draft, 32, tiny_pair.vocab)


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return load_model(tiny_pair.draft, "cpu")


def train_cfg(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides)


def base_overrides(tiny_pair, data: Path, tmp: Path, *extra: str) -> list[str]:
    return [f"pair.draft={tiny_pair.draft}", "pair.target=unused", "pair.device=cpu", f"data.path={data}",
            f"data.cache_dir={tmp / 'cache'}", f"out={tmp / 'head'}", "logger=none", "data.batch_size=4", *extra]


# -- library math -----------------------------------------------------------------------------------
def test_mixing_mask_fraction_and_determinism():
    masks = [mixing_mask(500, 0.15, seed=3, epoch=0, row=j) for j in range(40)]
    fraction = torch.cat(masks).float().mean().item()
    assert abs(fraction - 0.15) < 4 * math.sqrt(0.15 * 0.85 / 20000)  # 4 sigma
    assert torch.equal(masks[5], mixing_mask(500, 0.15, seed=3, epoch=0, row=5))
    assert not torch.equal(masks[5], mixing_mask(500, 0.15, seed=3, epoch=1, row=5))
    assert not torch.equal(masks[5], masks[6])
    assert not mixing_mask(50, 0.0, 0, 0, 0).any()
    with pytest.raises(ValueError, match="mixing ratio"):
        mixing_mask(5, 1.0, 0, 0, 0)


def test_mixed_example_positions_and_labels():
    prompt, x, y = [7, 8, 9], [10, 11, 12, 13], [20, 11, 22, 23]
    p = [0.1, 1.0, 0.3, 0.4]
    take_target = torch.tensor([True, False, True, False])
    ids, positions, labels = mixed_example(prompt, x, y, p, take_target)
    assert ids.tolist() == [7, 8, 9, 10, 11, 12, 23]  # Z = X, Y, X, Y
    # loss where Z_i comes from Y (i = 2, 4): hidden output at token Z_i, index len(prompt) + i - 1
    assert positions.tolist() == [4, 6]
    assert ids[positions].tolist() == [11, 23]
    assert labels.tolist() == pytest.approx([1.0, 0.4])


def test_draft_features_are_the_engines_hidden_state_at_each_candidate(draft):
    """e_i fed to the head = final hidden state after reading x, Z_1..Z_i (what the engine passes)."""
    rows = [{"row": j, **{k: torch.tensor(v[j]) for k, v in random_rows(3, 320, 9).items()
                          if k in ("prompt_ids", "target_ids", "draft_ids", "p_acc")}} for j in range(3)]
    hidden, labels = mixed_features(draft, rows, ratio=0.3, seed=1, epoch=0)
    for r, h in zip(rows, hidden):
        ids, positions, _ = mixed_example(r["prompt_ids"], r["target_ids"], r["draft_ids"], r["p_acc"],
                                          mixing_mask(len(r["target_ids"]), 0.3, 1, 0, r["row"]))
        assert h.shape == (len(positions), 32)
        for k, pos in enumerate(positions.tolist()):
            alone = draft(ids[None, : pos + 1], output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(h[k], alone, atol=1e-5, rtol=1e-4)


def test_weighted_bce_matches_hand_computation_and_authors_two_class_form():
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0])
    p = torch.tensor([1.0, 0.2, 0.7, 0.0])
    w_rej = 6.0
    q = [1 / (1 + math.exp(-v)) for v in logits.tolist()]
    num = sum(-pi * math.log(qi) - w_rej * (1 - pi) * math.log(1 - qi) for pi, qi in zip(p.tolist(), q))
    den = w_rej * sum(1 - pi for pi in p.tolist()) + sum(p.tolist())
    assert weighted_bce(logits, p, w_rej).item() == pytest.approx(num / den, rel=1e-6)
    # the authors' formulation: 2-class CE with class weights [w_rej, 1], soft labels, same normaliser
    two_class = torch.stack([torch.zeros_like(logits), logits], dim=-1)
    ce = torch.nn.CrossEntropyLoss(weight=torch.tensor([w_rej, 1.0]), reduction="none")
    loss0, loss1 = ce(two_class, torch.zeros(4, dtype=torch.long)), ce(two_class, torch.ones(4, dtype=torch.long))
    authors = ((loss0 * (1 - p) + loss1 * p).sum() / (w_rej * (1 - p).sum() + p.sum())).item()
    assert weighted_bce(logits, p, w_rej).item() == pytest.approx(authors, rel=1e-6)
    empty = weighted_bce(torch.zeros(0, requires_grad=True), torch.zeros(0), w_rej)
    assert empty.item() == 0.0 and empty.requires_grad


def test_binary_kl_is_bce_minus_entropy():
    p = torch.tensor([0.0, 0.3, 0.9, 1.0])
    exact = torch.logit(torch.tensor([0.5, 0.3, 0.9, 0.5]))
    assert binary_kl(exact, p)[1:3].abs().max() < 1e-6  # zero where P_hat = P
    logits = torch.tensor([1.0, -0.5, 0.2, 3.0])
    q = torch.sigmoid(logits)
    kl = p * torch.log(torch.where(p > 0, p, 1) / q) + (1 - p) * torch.log(torch.where(p < 1, 1 - p, 1) / (1 - q))
    torch.testing.assert_close(binary_kl(logits, p), kl)
    assert binary_entropy(torch.tensor([0.0, 1.0, 0.5])).tolist() == pytest.approx([0, 0, math.log(2)])


def test_calibration_and_auroc_match_torchmetrics_on_hard_labels():
    from torchmetrics.classification import BinaryAUROC, BinaryCalibrationError

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(400, generator=g)
    hard = (torch.rand(400, generator=g) < torch.sigmoid(1.5 * logits)).float()
    ours = SoftCalibrationError()
    ours.update(logits[:150], hard[:150])
    ours.update(logits[150:], hard[150:])
    reference = BinaryCalibrationError(n_bins=15)(torch.sigmoid(logits), hard.long())
    assert ours.compute().item() == pytest.approx(reference.item(), abs=1e-6)
    auroc = RejectionAUROC()
    auroc.update(logits, hard)
    assert auroc.compute().item() == pytest.approx(BinaryAUROC()(-logits, (1 - hard).long()).item(), abs=1e-6)


def test_soft_auroc_equals_auroc_of_the_expanded_hard_labels():
    """A label P = 1/2 counts as half an acceptance and half a rejection: the same as listing every
    position twice, with hard labels (P >= 1/2, P == 1)."""
    from torchmetrics.classification import BinaryAUROC

    logits = torch.tensor([2.0, 1.0, 0.5, -0.3, -1.0, 0.5])
    soft = torch.tensor([1.0, 0.5, 0.0, 0.5, 0.0, 1.0])
    expanded = torch.cat([(soft >= 0.5).float(), (soft == 1.0).float()])
    reference = BinaryAUROC()(-torch.cat([logits, logits]), (1 - expanded).long())
    assert reference.item() != pytest.approx(0.5)
    assert rejection_auroc(logits, soft).item() == pytest.approx(reference.item(), abs=1e-6)
    count, sum_prob, sum_label = calibration_bins(torch.tensor([0.05, 0.06, 0.95]), torch.tensor([0.0, 0.5, 1.0]), 10)
    assert expected_calibration_error(count, sum_prob, sum_label).item() == pytest.approx((0.39 + 0.05) / 3)
