"""train: token mixing, weighted BCE, metrics, feature cache, the Hydra app, resume, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdecpp.models.loading import load_model
from specdecpp.stopping.head import AcceptanceHead
from specdecpp.training.loss import weighted_bce
from specdecpp.training.metrics import (
    binary_entropy,
    binary_kl,
    calibration_bins,
    expected_calibration_error,
    rejection_auroc,
)
from specdecpp.training.mixing import mixed_example, mixed_features, mixing_mask
from tests.helpers.paths import CONF, REPO
from tests.helpers.train import COLUMNS, base_overrides, random_rows, save_dataset, train_cfg
from train import run
from train.cache import feature_cache
from train.checks import check_draft_matches, load_dataset_dir
from train.data import HeadDataModule
from train.metrics import RejectionAUROC, SoftCalibrationError
from train.module import AcceptanceHeadModule


@pytest.fixture(scope="module")
def tiny_dataset(tiny_pair, tmp_path_factory):
    splits = {"train": random_rows(24, tiny_pair.vocab, 1), "dev": random_rows(8, tiny_pair.vocab, 2),
              "test": random_rows(8, tiny_pair.vocab, 3)}
    return save_dataset(tmp_path_factory.mktemp("tiny_data"), splits, tiny_pair.draft, 32, tiny_pair.vocab)


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return load_model(tiny_pair.draft, "cpu")



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
    for r, h in zip(rows, hidden, strict=True):
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
    num = sum(-pi * math.log(qi) - w_rej * (1 - pi) * math.log(1 - qi) for pi, qi in zip(p.tolist(), q, strict=True))
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


# -- features: cached == on the fly -------------------------------------------------------------
def data_module(splits, draft, tiny_pair, tmp_path, cache: bool, batch_size: int = 4) -> HeadDataModule:
    return HeadDataModule(splits, train_split="train", val_split="dev", draft=draft, draft_ref=tiny_pair.draft,
                          batch_size=batch_size, num_workers=0, mix_ratio=0.15, mix_seed=7, seed=0,
                          cache_features=cache, cache_dir=str(tmp_path / "cache"), cache_dtype="float32",
                          feature_batch_size=3)


def head_module(draft, remix: bool = False, depth: int = 2) -> AcceptanceHeadModule:
    torch.manual_seed(0)
    return AcceptanceHeadModule(AcceptanceHead(32, depth), optimizer=torch.optim.Adam, w_rej=6.0,
                                mix_ratio=0.15, mix_seed=7, remix_each_epoch=remix, draft=draft)


def test_cached_and_on_the_fly_features_give_the_same_batch_loss(tiny_dataset, tiny_pair, draft, tmp_path):
    from datasets import load_from_disk

    splits = load_from_disk(str(tiny_dataset))
    module = head_module(draft)
    cached = data_module(splits, draft, tiny_pair, tmp_path, cache=True).loader("train")
    raw = data_module(splits, draft, tiny_pair, tmp_path, cache=False).loader("train")
    n_batches = 0
    for cached_batch, raw_batch in zip(cached, raw, strict=True):
        hidden, labels = module.features(raw_batch, epoch=0)
        torch.testing.assert_close(cached_batch["hidden"], hidden, atol=1e-5, rtol=1e-5)
        assert torch.equal(cached_batch["labels"], labels)
        loss_cached, _, _ = module.model_step(cached_batch)
        loss_raw, _, _ = module.model_step(raw_batch)
        assert loss_cached.item() == pytest.approx(loss_raw.item(), rel=1e-5)
        n_batches += 1
    assert n_batches == 6
    # a new epoch's mixing (remix_each_epoch) gives other inputs, hence other features
    other_hidden, other_labels = module.features(next(iter(raw)), epoch=1)
    first = next(iter(cached))
    assert other_labels.shape != first["labels"].shape or not torch.equal(other_labels, first["labels"])


def test_cache_is_reused_and_an_interrupted_build_resumes(tiny_dataset, tiny_pair, draft, tmp_path, monkeypatch):
    from datasets import load_from_disk

    import train.cache

    split = load_from_disk(str(tiny_dataset))["train"]  # 24 prompts, chunks of 5
    calls = []
    real = train.cache.mixed_features

    def failing_after_two_chunks(draft_model, rows, *args):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append([r["row"] for r in rows])
        return real(draft_model, rows, *args)

    monkeypatch.setattr(train.cache, "mixed_features", failing_after_two_chunks)
    with pytest.raises(KeyboardInterrupt):
        feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.15, 7, batch_size=5)
    assert calls == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    calls.clear()
    monkeypatch.setattr(train.cache, "mixed_features", lambda *a: (calls.append([r["row"] for r in a[1]]), real(*a))[1])
    resumed = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.15, 7, batch_size=5)
    assert [row for chunk in calls for row in chunk] == list(range(10, 24))  # no row computed twice
    fresh = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path / "fresh", 0.15, 7, batch_size=24)
    np.testing.assert_allclose(resumed.features, fresh.features, atol=1e-5)
    np.testing.assert_array_equal(resumed.labels, fresh.labels)
    calls.clear()
    again = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.15, 7, batch_size=5)
    assert calls == [] and again.directory == resumed.directory  # complete cache: the draft does not run
    other = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.3, 7, batch_size=24)
    assert other.directory != resumed.directory  # another mixing ratio is another cache
    kept = sum(int((~mixing_mask(len(x), 0.15, 7, 0, j)).sum()) for j, x in enumerate(split["target_ids"]))
    assert resumed.features.shape == (kept, 32) and len(resumed) == 24
    import pickle

    shipped = pickle.loads(pickle.dumps(resumed))  # as sent to DataLoader workers: the memory maps reopen
    assert isinstance(shipped.features, np.memmap) and len(pickle.dumps(resumed)) < 1000
    assert all(torch.equal(a, b) for a, b in zip(shipped.row(3), resumed.row(3), strict=True))


def test_a_bf16_draft_keys_its_own_cache_with_its_own_features(tiny_dataset, tiny_pair, draft, tmp_path):
    """Features of a draft computing in bf16 (pair.dtype=fast/bfloat16) are not a float32 draft's:
    they go to another cache, and they are the bf16 draft's hidden states."""
    import copy

    from datasets import load_from_disk

    split = load_from_disk(str(tiny_dataset))["train"]
    fp32 = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.15, 7, batch_size=24)
    bf16_draft = copy.deepcopy(draft).to(torch.bfloat16)
    bf16 = feature_cache(split, "train", bf16_draft, tiny_pair.draft, tmp_path, 0.15, 7, batch_size=24,
                         draft_precision="bfloat16")
    assert bf16.directory != fp32.directory and bf16.info["draft_precision"] == "bfloat16"
    assert "draft_precision" not in fp32.info  # float32 caches keep their old keys
    a, b = np.asarray(fp32.features), np.asarray(bf16.features)
    assert a.shape == b.shape and not np.array_equal(a, b)
    np.testing.assert_allclose(b, a, atol=0.1, rtol=0.05)  # bf16 rounding, not other features


def test_two_jobs_building_one_cache_at_once_run_the_draft_once(tiny_dataset, tiny_pair, draft, tmp_path,
                                                                monkeypatch):
    """A parallel sweep launcher: the second job waits on the build lock, then reads the cache."""
    import threading

    from datasets import load_from_disk

    import train.cache

    split = load_from_disk(str(tiny_dataset))["train"]
    rows, real = [], train.cache.mixed_features
    monkeypatch.setattr(train.cache, "mixed_features", lambda *a: (rows.extend(r["row"] for r in a[1]), real(*a))[1])
    caches = []
    jobs = [threading.Thread(target=lambda: caches.append(
        feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.15, 7, batch_size=4))) for _ in range(2)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    assert sorted(rows) == list(range(24))
    assert len(caches) == 2 and np.array_equal(caches[0].features, caches[1].features)


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
    assert (model.keywords["w_rej"], model.keywords["w_acc"], model.keywords["mix_ratio"], model.keywords["mix_seed"]) == \
        (12, 1, 0.2, 4)
    optimizer = model.keywords["optimizer"](params=[torch.zeros(1, requires_grad=True)])
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 3e-3
    module = model(head=AcceptanceHead(32, 1))
    assert (module.hparams.w_rej, module.hparams.warmup_ratio, module.hparams.remix_each_epoch) == (12, 0.03, False)
    data = instantiate(cfg.datamodule)
    assert data.func is HeadDataModule
    assert (data.keywords["batch_size"], data.keywords["seed"], data.keywords["train_split"]) == (8, 4, "train")


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
    assert (config["draft"], config["depth"], config["hidden_size"], config["target"]) == (tiny_pair.draft, 0, 32, "tiny-target")
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


def test_best_weights_are_the_monitored_best_epochs_and_survive_a_resume(tiny_dataset, tiny_pair, tmp_path,
                                                                        monkeypatch):
    """weights=best_val keeps the weights of the epoch whose monitored val/loss is lowest (Lightning's
    ModelCheckpoint(monitor="val/loss")): a run whose val/loss is best at epoch 1 of 3 saves epoch 1's
    head, not epoch 0's or 2's; a run interrupted in epoch 2 and resumed still does."""
    scripted = {0: 0.5, 1: 0.2, 2: 0.9}  # val/loss by epoch: best at epoch 1
    snapshots = {}
    real_end, real_step = AcceptanceHeadModule.on_validation_epoch_end, AcceptanceHeadModule.training_step

    def scripted_end(self):
        self._val_sum = scripted[self.current_epoch] * self._val_count
        real_end(self)
        snapshots[self.current_epoch] = {k: v.clone() for k, v in self.head.state_dict().items()}

    def crashing_step(self, batch, batch_idx):
        if self.global_step == crash_at:
            raise RuntimeError("simulated crash")
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(AcceptanceHeadModule, "on_validation_epoch_end", scripted_end)
    monkeypatch.setattr(AcceptanceHeadModule, "training_step", crashing_step)

    def overrides(out):  # 6 steps per epoch, a checkpoint every 2
        return [*base_overrides(tiny_pair, tiny_dataset, tmp_path, "trainer=cpu", "trainer.max_epochs=3"),
                "+experiment=wrej3_d1", "~callbacks.progress_bar", "callbacks.checkpoint.every_n_train_steps=2",
                "optimizer.lr=0.05", f"out={out}"]

    crash_at = -1
    result = run(train_cfg(overrides(tmp_path / "one")))
    assert result["module"].val_loss_per_epoch == pytest.approx([0.5, 0.2, 0.9])
    saved = AcceptanceHead.from_pretrained(tmp_path / "one")
    torch.testing.assert_close(saved.state_dict(), snapshots[1])
    for other in (0, 2):  # the weights did change between epochs: the choice is visible
        assert not torch.allclose(saved.state_dict()["blocks.0.linear.weight"],
                                  snapshots[other]["blocks.0.linear.weight"]), other
    assert (saved.meta["training"]["weights"], saved.meta["training"]["best_epoch"]) == ("best_val", 1)
    torch.testing.assert_close(result["module"].head.cpu().state_dict(), snapshots[1])  # evaluated with them

    first_run = dict(snapshots)
    snapshots.clear()
    crash_at = 14  # in epoch 2, after the checkpoint at step 14: resumed from there
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(train_cfg(overrides(tmp_path / "two")))
    assert sorted(snapshots) == [0, 1]
    crash_at = -1
    snapshots.clear()
    resumed = AcceptanceHead.from_pretrained(run(train_cfg(overrides(tmp_path / "two")))["out"])
    assert sorted(snapshots) == [2]  # only epoch 2 ran again: epoch 1's best came from the checkpoint
    assert resumed.meta["training"]["best_epoch"] == 1
    torch.testing.assert_close(resumed.state_dict(), first_run[1])


def test_interrupted_run_resumes_from_its_last_checkpoint(tiny_dataset, tiny_pair, tmp_path, monkeypatch):
    """Crash at step 5 with checkpoints every 2 steps; the same command resumes at step 4 mid-epoch
    and trains on exactly the prompts an uninterrupted run would (raw rows show which)."""
    def overrides(out):
        return [*base_overrides(tiny_pair, tiny_dataset, tmp_path, "trainer=cpu", "trainer.max_epochs=2"),
                "+experiment=wrej3_d1", "callbacks.checkpoint.every_n_train_steps=2", "~callbacks.progress_bar",
                "data.cache_features=false", f"out={out}"]

    seen = []
    real_step = AcceptanceHeadModule.training_step

    def recording_step(self, batch, batch_idx):
        if self.global_step == crash_at:
            raise RuntimeError("simulated crash")
        seen.append((self.global_step, tuple(batch["row"])))
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(AcceptanceHeadModule, "training_step", recording_step)
    crash_at = -1
    reference = run(train_cfg(overrides(tmp_path / "reference")))
    uninterrupted, seen = seen, []
    assert [step for step, _ in uninterrupted] == list(range(12))  # 24 prompts / 4 per batch x 2 epochs

    crash_at = 5
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(train_cfg(overrides(tmp_path / "head")))
    last = tmp_path / "head" / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4
    assert not (tmp_path / "head" / "model.safetensors").exists()

    crash_at, before = -1, seen[:4]
    seen = []
    result = run(train_cfg(overrides(tmp_path / "head")))  # the same command again
    assert [step for step, _ in seen] == list(range(4, 12))
    assert before + seen == uninterrupted  # same prompts in the same order: none lost, none repeated
    assert result["global_step"] == 12
    assert AcceptanceHead.from_pretrained(tmp_path / "head").meta["training"]["global_step"] == 12
    torch.testing.assert_close(result["module"].head.state_dict(), reference["module"].head.state_dict())

    with pytest.raises(ValueError, match="checkpoint of a different training run.*loss.w_rej: 3.*12"):
        run(train_cfg([*overrides(tmp_path / "head"), "loss.w_rej=12"]))


def test_ranks_share_every_global_batch_once_even_when_smaller_than_the_world(tiny_pair):
    """N ranks together step through exactly the batches of one process, in the same steps; a
    rank whose share of a small last batch is empty still steps (a zero loss with a graph)."""
    from train.data import EpochShuffle, RankBatches, collate_cached

    one = list(RankBatches(EpochShuffle(11, 3), 5))
    for world in (2, 3, 7):
        ranks = [list(RankBatches(EpochShuffle(11, 3), 5, rank, world)) for rank in range(world)]
        assert all(len(r) == len(one) == 3 for r in ranks)
        assert [sum((r[step] for r in ranks), []) for step in range(3)] == one
    assert [len(r[2]) for r in [list(RankBatches(EpochShuffle(11, 3), 5, k, 3)) for k in range(3)]] == [0, 0, 1]
    module = AcceptanceHeadModule(AcceptanceHead(32, 1), optimizer=torch.optim.Adam, w_rej=3.0)
    loss, logits, labels = module.model_step(collate_cached([]))
    assert float(loss.detach()) == 0.0 and loss.requires_grad and logits.shape == labels.shape == (0,)


def test_ddp_on_two_cpu_processes_trains_the_one_process_head_and_resumes(tiny_dataset, tiny_pair, tmp_path):
    """trainer=ddp with 2 CPU processes (gloo): the run crashes at step 5 (checkpoint at step 4),
    the same command resumes it; the saved head and its metrics equal those of one process
    (global batch 5: rank shares of 2 and 3 prompts; 2 and 2 for the last one)."""
    import os
    import subprocess
    import sys

    def overrides(out, *extra):
        return [*base_overrides(tiny_pair, tiny_dataset, tmp_path, "trainer=cpu", "trainer.max_epochs=2"),
                "+experiment=wrej3_d1", "data.batch_size=5", "callbacks.checkpoint.every_n_train_steps=2",
                "~callbacks.progress_bar", "~callbacks.lr_monitor", "trainer.enable_model_summary=false",
                f"out={out}", *extra]

    reference = run(train_cfg(overrides(tmp_path / "one")))
    command = [sys.executable, "-m", "train", *overrides(
        tmp_path / "ddp", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
        "+callbacks.crash._target_=tests.helpers.crash_callback.CrashOnce", "+callbacks.crash.step=5",
        f"+callbacks.crash.marker={tmp_path / 'crashed'}", f"hydra.run.dir={tmp_path / 'hydra'}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    crashed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert crashed.returncode != 0 and "simulated crash at step 5" in crashed.stderr, crashed.stderr[-3000:]
    assert torch.load(tmp_path / "ddp" / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 4
    resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr + resumed.stdout

    ddp = AcceptanceHead.from_pretrained(tmp_path / "ddp")
    torch.testing.assert_close(ddp.state_dict(), reference["module"].head.state_dict(), atol=1e-5, rtol=1e-4)
    assert ddp.meta["training"]["global_step"] == reference["global_step"] == 10  # 5 batches x 2 epochs
    assert ddp.meta["training"]["val_loss_per_epoch"] == pytest.approx(reference["module"].val_loss_per_epoch, rel=1e-5)
    one, two = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("one", "ddp"))
    for split in one:  # reduced over the ranks: every position counted once
        assert two[split]["positions"] == one[split]["positions"]
        assert two[split]["calibration_bins"]["count"] == one[split]["calibration_bins"]["count"]
        for key in ("KL", "KL_const", "ECE"):
            assert two[split][key] == pytest.approx(one[split][key], rel=1e-4, abs=1e-6), (split, key)
        # a rank order of logits: near-tied logits may swap under the heads' float differences
        assert two[split]["AUROC"] == pytest.approx(one[split]["AUROC"], abs=1e-3), split


def test_a_finished_run_is_not_resumed_by_another_training(tiny_dataset, tiny_pair, tmp_path):
    """A finished run leaves last.ckpt; another preset, dataset or seed into the same out must not
    resume it (it would train zero steps and save the old weights under the new record)."""
    def overrides(preset, data=tiny_dataset, *extra):
        return [*base_overrides(tiny_pair, data, tmp_path, "trainer=cpu"), f"+experiment=[wrej6_d3,{preset}]",
                "trainer.max_epochs=2", "~callbacks.progress_bar", "~callbacks.lr_monitor", *extra]

    first = run(train_cfg(overrides("small_data")))
    assert (tmp_path / "head" / "ckpt" / "last.ckpt").is_file() and first["global_step"] == 12
    with pytest.raises(ValueError) as error:
        run(train_cfg(overrides("paper")))
    message = str(error.value)
    for key in ("optimizer.lr: 0.003 there, 5e-05 now", "callbacks.early_stopping.monitor"):
        assert key in message, message
    assert "choose another out=" in message and f"delete {tmp_path / 'head' / 'ckpt'}" in message
    other = save_dataset(tmp_path / "other_data", {"train": random_rows(24, tiny_pair.vocab, 7),
                                                   "dev": random_rows(8, tiny_pair.vocab, 8)},
                         tiny_pair.draft, 32, tiny_pair.vocab)
    with pytest.raises(ValueError, match="differs in: dataset_fingerprint"):
        run(train_cfg(overrides("small_data", other)))
    with pytest.raises(ValueError, match="differs in: data.mix_seed: 0 there, 1 now; data.val_seed: 0 there, 1 now; seed: 0 there, 1 now"):
        run(train_cfg(overrides("small_data", tiny_dataset, "seed=1")))
    again = run(train_cfg(overrides("small_data")))  # the same command: the same run, resumed (done)
    assert again["global_step"] == 12


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


# -- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("loss.w_rej=0", "w_rej must be > 0"),
    ("loss.w_rej=-3", "w_rej must be > 0"),
    ("data.remix_each_epoch=true", "set one of them to false"),
    ("data.mix_ratio=1.5", r"mix_ratio must be in \[0, 1\)"),
])
def test_bad_settings_fail_before_anything_is_written(tiny_dataset, tiny_pair, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        run(train_cfg([*base_overrides(tiny_pair, tiny_dataset, tmp_path), override]))
    assert not (tmp_path / "head").exists() and not (tmp_path / "cache").exists()


def test_missing_draft_or_dataset_path_is_named(tiny_pair, tmp_path):
    data = save_dataset(tmp_path / "data", {"train": random_rows(4, tiny_pair.vocab, 0)}, None, 32, tiny_pair.vocab)
    with pytest.raises(ValueError, match="pair.draft is not set and dataset .* records no draft"):
        run(train_cfg([f"data.path={data}", f"out={tmp_path / 'head'}"]))
    with pytest.raises(ValueError, match="data.path is not set"):
        run(train_cfg(["pair.draft=somewhere", f"out={tmp_path / 'head'}"]))
    assert not (tmp_path / "head").exists()


def corrupt(rows: dict, column: str, value) -> dict:
    rows = {k: [list(v) if isinstance(v, list) else v for v in vs] for k, vs in rows.items()}
    rows[column][1][2] = value
    return rows


@pytest.mark.parametrize("case, message", [
    ("empty_split", "a split has no rows|split 'train' .* is empty"),
    ("no_response_tokens", "split 'dev' .* has no response tokens"),
    ("nan", "split 'train': p_acc has non-finite values"),
    ("above_one", r"split 'dev': p_acc must lie in \[0, 1\]"),
    ("lengths_differ", "split 'train' row 1 .*: draft_ids has 3 entries but target_ids has"),
    ("unfinished", "data_gen did not finish"),
    ("token_out_of_vocab", "outside the draft's vocabulary"),
    ("other_draft", "does not match the configured draft.*allow_draft_mismatch"),
    ("missing", "directory not found; run data_gen first"),
])
def test_bad_datasets_get_clear_errors(tiny_pair, tmp_path, case, message):
    good = random_rows(4, tiny_pair.vocab, 0)
    splits = {"train": good, "dev": good}
    draft, hidden = tiny_pair.draft, 32
    if case == "empty_split":
        splits["train"] = {k: [] for k in COLUMNS}
    elif case == "no_response_tokens":
        splits["dev"] = {k: [[] if k in ("target_ids", "draft_ids", "p_acc", "draft_entropy") else v
                             for v in vs] for k, vs in good.items()}
    elif case == "nan":
        splits["train"] = corrupt(good, "p_acc", float("nan"))
    elif case == "above_one":
        splits["dev"] = corrupt(good, "p_acc", 1.5)
    elif case == "token_out_of_vocab":
        splits["train"] = corrupt(good, "draft_ids", tiny_pair.vocab + 5)
    elif case == "lengths_differ":
        splits["train"] = {**good, "draft_ids": [v if j != 1 else [5, 6, 7] for j, v in enumerate(good["draft_ids"])]}
    elif case == "other_draft":
        draft, hidden = "someone/other-draft", 64
    data = tmp_path / "data"
    if case != "missing":
        save_dataset(data, splits, draft, hidden, tiny_pair.vocab)
        if case == "unfinished":
            meta = json.loads((data / "specdecpp_meta.json").read_text())
            (data / "specdecpp_meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        run(train_cfg(base_overrides(tiny_pair, data, tmp_path)))
    assert not (tmp_path / "head").exists()


@pytest.mark.parametrize("keep", [0, 100, 0.5])
def test_a_damaged_arrow_file_is_named_with_how_to_regenerate(tiny_pair, tmp_path, keep):
    data = save_dataset(tmp_path / "data", {"train": random_rows(30, tiny_pair.vocab, 0),
                                            "dev": random_rows(6, tiny_pair.vocab, 1)},
                        tiny_pair.draft, 32, tiny_pair.vocab)
    arrow = next((data / "train").glob("*.arrow"))
    size = arrow.stat().st_size
    arrow.write_bytes(arrow.read_bytes()[: int(size * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=rf"the dataset is damaged: {arrow} \(split 'train'\) cannot be read.*"
                                         r"rerun the data_gen command that made it") as error:
        run(train_cfg(base_overrides(tiny_pair, data, tmp_path)))
    assert "pyarrow" not in str(error.value)
    assert not (tmp_path / "head").exists()


def test_draft_mismatch_can_be_overridden_for_a_renamed_draft(tiny_pair):
    meta = {"draft": "/somewhere/else/draft", "draft_hidden_size": 32}
    with pytest.raises(ValueError, match="made with draft '/somewhere/else/draft'"):
        check_draft_matches(meta, tiny_pair.draft, 32, "DIR", allow_mismatch=False)
    check_draft_matches(meta, tiny_pair.draft, 32, "DIR", allow_mismatch=True)
    check_draft_matches({"draft": tiny_pair.draft + "/", "draft_hidden_size": 32}, tiny_pair.draft, 32, "DIR", False)


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


@pytest.mark.parametrize("case, message", [
    ("sampling", r"differ in sampling"),
    ("draft", r"differ in draft"),
    ("leak", r"1 prompt\(s\) of the joined 'dev' split are also in 'train'"),
    ("empty", "data.path is an empty list"),
])
def test_joining_datasets_of_another_pair_or_with_leaked_prompts_is_refused(tiny_pair, tmp_path, case, message):
    vocab = tiny_pair.vocab
    dev = random_rows(4, vocab, 2)
    a = save_dataset(tmp_path / "a", {"train": random_rows(6, vocab, 1), "dev": dev}, tiny_pair.draft, 32, vocab)
    b_train = random_rows(6, vocab, 3)
    if case == "leak":  # B labelled one of A's dev prompts as training data
        b_train = {k: [*v[:-1], dev[k][0]] for k, v in b_train.items()}
    b = save_dataset(tmp_path / "b", {"train": b_train}, tiny_pair.target if case == "draft" else tiny_pair.draft,
                     32, vocab)
    if case == "sampling":
        meta = json.loads((b / "specdecpp_meta.json").read_text())
        (b / "specdecpp_meta.json").write_text(json.dumps({**meta, "sampling": {**meta["sampling"], "top_k": 0}}))
    with pytest.raises(ValueError, match=message):
        run(train_cfg([*base_overrides(tiny_pair, a, tmp_path), "data.path=[]" if case == "empty" else
                       f"data.path=[{a},{b}]"]))
    assert not (tmp_path / "head").exists() and not (tmp_path / "cache").exists()


def test_learning_rate_schedule_is_warmup_then_cosine(draft):
    from types import SimpleNamespace

    from transformers import get_cosine_schedule_with_warmup

    module = head_module(draft)
    module._trainer = SimpleNamespace(estimated_stepping_batches=100)
    reference = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=1.0), 3, 100).lr_lambdas[0]
    assert [module.lr_factor(s) for s in range(101)] == pytest.approx([reference(s) for s in range(101)])


def test_trains_on_a_real_data_gen_output(tiny_pair, tmp_path):
    """The contract with data_gen: its output directory trains as is, and the head records it."""
    from data_gen import run as generate

    prompts = tmp_path / "prompts.jsonl"
    texts = ["Write a short poem about the sea.", "What is 12 times 7?", "def add(a, b):", "Explain binary search."]
    prompts.write_text("".join(json.dumps({"id": f"p{j}", "split": "train" if j < 3 else "dev", "prompt": t}) + "\n"
                               for j, t in enumerate(texts)))
    data = tmp_path / "data"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        generate(compose("data_gen", overrides=[
            f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "pair.device=cpu", "prompts=jsonl",
            f"prompts.path={prompts}", "splits=[train,dev]", f"out={data}", "max_new_tokens=8", "progress=false"]))
    result = run(train_cfg([*base_overrides(tiny_pair, data, tmp_path, "trainer=smoke", "callbacks=none"),
                            "+experiment=wrej6_d3"]))
    head = AcceptanceHead.from_pretrained(result["out"])
    assert head.meta["target"] == tiny_pair.target and head.draft == tiny_pair.draft
    assert set(result["metrics"]) == {"train", "dev"} and result["metrics"]["train"]["positions"] > 0


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


def test_engine_hands_the_head_the_features_train_learns_from(tiny_pair, tmp_path):
    """End to end: the engine runs with a spy policy that records every hidden state it is handed;
    for each one that sits on a committed token, train's features for the generated sequence (raw
    rows and the feature cache) hold the same vector at the same position."""
    from specdecpp import SamplingConfig, SpeculativeDecoder, StopPolicy, load_pair
    from specdecpp.data.prompts import encode_prompt

    class Spy(StopPolicy):
        name, max_candidates, needs_hidden = "spy", 4, True

        def __init__(self):
            self.rounds = []

        def new_round(self):
            self.rounds.append([])

        def should_stop(self, k, logits, hidden, token=None):
            self.rounds[-1].append((k, hidden.detach().clone()))
            return k >= self.max_candidates

    draft, target, tok = load_pair(tiny_pair.draft, tiny_pair.target, device="cpu")
    prompt = encode_prompt(tok, "Write a short poem about the sea.")
    spy = Spy()
    out = SpeculativeDecoder(draft, target, spy, SamplingConfig(temperature=1.0)).generate(
        torch.tensor([prompt]), max_new_tokens=40, generator=torch.Generator().manual_seed(3))
    response = out.tokens[0, len(prompt):].tolist()
    row = {"row": 0, "prompt_ids": torch.tensor(prompt), "target_ids": torch.tensor(response),
           "draft_ids": torch.tensor(response), "p_acc": torch.ones(len(response))}
    (raw,), _ = mixed_features(draft, [row], ratio=0.0, seed=0)  # every position is a Y-position
    split = Dataset.from_dict({"prompt_ids": [prompt], "target_ids": [response], "draft_ids": [response],
                               "p_acc": [[1.0] * len(response)]})
    cached, _ = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.0, 0).row(0)
    assert raw.shape == cached.shape == (len(response), 32)

    checked, n = {"k=1": 0, "k>=2": 0}, len(prompt)  # n: committed tokens at the start of the round
    for calls, accepted in zip(spy.rounds, out.stats.accept_lengths, strict=True):
        for k, hidden in calls:
            index = n + k - 2  # the state at y_{k-1} (at the last committed token when k == 1)
            if k - 1 > accepted or index < len(prompt):
                continue  # a rejected candidate, or a prompt token: no training position
            j = index - len(prompt)  # train: feature of response token j + 1 sits at len(prompt) + j
            torch.testing.assert_close(hidden, raw[j], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden, cached[j], atol=1e-4, rtol=1e-4)
            assert not torch.allclose(hidden, raw[j - 1], atol=1e-3) if j > 0 else True
            checked["k=1" if k == 1 else "k>=2"] += 1
        n += accepted + 1
    assert n == out.tokens.shape[1] and checked["k=1"] >= 5 and checked["k>=2"] >= 5, checked
