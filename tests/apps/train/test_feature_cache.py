"""train's feature cache: cached features equal the ones computed on the fly, an interrupted build
resumes, a bf16 draft gets its own cache, two jobs building one cache run the draft once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdecpp.training.mixing import mixing_mask
from tests.helpers.train import head_module
from train.cache import feature_cache
from train.data import HeadDataConfig, HeadDataModule


def data_module(splits, draft, tiny_pair, tmp_path, cache: bool, batch_size: int = 4) -> HeadDataModule:
    config = HeadDataConfig(train_split="train", val_split="dev", batch_size=batch_size, num_workers=0, mix_ratio=0.15,
                            mix_seed=7, seed=0, cache_features=cache, cache_dir=str(tmp_path / "cache"),
                            cache_dtype="float32", feature_batch_size=3)
    return HeadDataModule(splits, config, draft=draft, draft_ref=tiny_pair.draft)


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
