"""Batches for head training: cached draft features, or raw rows mixed on the fly.

A batch is a fixed group of prompts (``data.batch_size`` of them), so the loss normalisation runs
over the same Y-positions whichever way the features are obtained:
- cached: ``{"hidden": [M, H], "labels": [M]}``, the M Y-positions of the batch's prompts;
- raw: ``{"row", "prompt_ids", "target_ids", "draft_ids", "p_acc"}`` lists; the module mixes the
  tokens (mask of the current epoch or the fixed one) and runs the draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, SequentialSampler

from specdecpp.models.loading import dtype_name, resolve_device, resolve_dtype

from .cache import feature_cache

RAW_COLUMNS = ["prompt_ids", "target_ids", "draft_ids", "p_acc"]


class CachedRows(Dataset):
    def __init__(self, cache) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, j: int) -> dict:
        hidden, labels = self.cache.row(j)
        return {"hidden": hidden, "labels": labels}


class RawRows(Dataset):
    def __init__(self, split) -> None:
        self.split = split.select_columns(RAW_COLUMNS).with_format("torch")

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, j: int) -> dict:
        return {**self.split[j], "row": j}


def collate_cached(items: list[dict]) -> dict:
    if not items:  # this rank's share of a global batch smaller than the number of ranks
        return {}
    return {"hidden": torch.cat([i["hidden"] for i in items]), "labels": torch.cat([i["labels"] for i in items])}


def collate_raw(items: list[dict]) -> dict:
    if not items:
        return {}
    return {key: [i[key] for i in items] for key in ["row", *RAW_COLUMNS]}


def rank_share(batch: list[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s contiguous part of a global batch (parts differ by at most one prompt; empty
    when the batch has fewer prompts than ranks): the ranks together cover the batch once."""
    n = len(batch)
    return batch[rank * n // world_size:(rank + 1) * n // world_size]


class EpochShuffle(Sampler[int]):
    """A fresh permutation per epoch, drawn from (seed, epoch), so a resumed run sees the same
    order; ``skip`` drops the first items of one given epoch (mid-epoch resume)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0
        self.skip_epoch, self.skip = -1, 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this before every epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))
        skip = self.skip if self.epoch == self.skip_epoch else 0
        self.skip_epoch, self.skip = -1, 0
        return iter(order[skip:].tolist())


class RankBatches(Sampler[list[int]]):
    """Global batches of ``batch_size`` prompts drawn from ``sampler``, of which this rank takes its
    :func:`rank_share`: N DDP ranks together step through exactly the batches of one process."""

    def __init__(self, sampler: Sampler[int], batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        self.sampler, self.batch_size, self.rank, self.world_size = sampler, batch_size, rank, world_size

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield rank_share(batch, self.rank, self.world_size)
                batch = []
        if batch:
            yield rank_share(batch, self.rank, self.world_size)


class ResumableLoader(DataLoader):
    """Training loader whose position Lightning saves in checkpoints (``state_dict``) and restores
    on resume (``load_state_dict``): an interrupted epoch continues with the prompts it had not
    reached, none skipped or repeated. The position counts batches handed out; Lightning does not
    fetch ahead from a loader of known length, so that is the number of batches trained on."""

    def __init__(self, dataset: Dataset, *, seed: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 **kwargs) -> None:
        shuffle = EpochShuffle(len(dataset), seed)
        super().__init__(dataset, batch_sampler=RankBatches(shuffle, batch_size, rank, world_size), **kwargs)
        self.shuffle, self.global_batch_size, self.served = shuffle, batch_size, 0

    def __iter__(self):
        shuffle = self.shuffle
        self.served = shuffle.skip // self.global_batch_size if shuffle.epoch == shuffle.skip_epoch else 0
        for batch in super().__iter__():
            self.served += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.shuffle.epoch, "batches_done": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.shuffle.skip_epoch, self.shuffle.skip = state["epoch"], state["batches_done"] * self.global_batch_size


@dataclass(frozen=True)
class HeadDataConfig:
    """The settings of :class:`HeadDataModule`: which splits, how prompts are batched and mixed,
    and whether and how the draft's features are cached. Built from a composed train config in one
    place, :meth:`from_cfg` (the public keys ``data.*``, ``seed`` and the pair's precision)."""

    train_split: str
    val_split: str | None          # None: no validation
    batch_size: int                # prompts per (global) batch
    num_workers: int
    mix_ratio: float
    mix_seed: int
    seed: int                      # the training order's shuffle
    cache_features: bool           # cached draft features (else raw rows, mixed and run through the draft)
    cache_dir: str
    cache_dtype: str
    feature_batch_size: int        # prompts per draft forward when building a cache
    draft_precision: str = "float32"  # the dtype the draft computes its features in (a cache key)

    @classmethod
    def from_cfg(cls, cfg, val_split: str | None) -> HeadDataConfig:
        """From a composed train config (conf/train.yaml): ``data.*``, ``seed`` and the precision
        ``pair.dtype`` gives on ``pair.device``; ``val_split`` is the one validated on (``data.val_split``
        or train.app's held-out slice)."""
        data = cfg.data
        return cls(train_split=data.train_split, val_split=val_split, batch_size=data.batch_size,
                   num_workers=data.num_workers, mix_ratio=data.mix_ratio, mix_seed=data.mix_seed, seed=cfg.seed,
                   cache_features=data.cache_features, cache_dir=data.cache_dir, cache_dtype=data.cache_dtype,
                   feature_batch_size=data.feature_batch_size,
                   draft_precision=dtype_name(resolve_dtype(cfg.pair.dtype, resolve_device(cfg.pair.device))))


class HeadDataModule(L.LightningDataModule):
    """Train/validation loaders (and a loader per split for the final evaluation) of ``splits`` under
    ``config``. ``draft`` is the draft model or a function that loads it (called only where the
    draft must run), ``draft_ref`` how the draft is named (a cache key); ``feature_spec`` /
    ``feature_size``: the head's (see specdecpp.stopping.head; None: the paper's head)."""

    def __init__(self, splits, config: HeadDataConfig, *, draft, draft_ref: str,
                 feature_spec: dict | None = None, feature_size: int | None = None, target=None) -> None:
        super().__init__()
        for name in (config.train_split, config.val_split):
            if name is not None and name not in splits:
                raise ValueError(f"dataset has no split {name!r} (it has {list(splits)}); set "
                                 "data.train_split / data.val_split (null for no validation)")
        self.splits, self.config = splits, config
        self.draft, self.draft_ref, self.target = draft, draft_ref, target  # target: a feature draft's
        self.feature_spec, self.feature_size = feature_spec, feature_size
        self._sets: dict[str, Dataset] = {}

    def _rank(self) -> tuple[int, int]:
        """(rank, world size) under the trainer: every global batch is split over the ranks here
        (trainer.use_distributed_sampler=false, conf/trainer/ddp.yaml), not by Lightning."""
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def prepare_data(self) -> None:
        """Build the feature caches on one process per node (Lightning calls this on local rank 0,
        then lets the other ranks in): they open the finished caches without loading the draft."""
        if self.config.cache_features:
            for name in self.splits:
                self._cache(name)

    def _cache(self, name: str):
        c = self.config
        return feature_cache(self.splits[name], name, self.draft, self.draft_ref, c.cache_dir, c.mix_ratio, c.mix_seed,
                             c.cache_dtype, c.feature_batch_size, self.feature_spec, self.feature_size,
                             c.draft_precision, target=self.target)

    def dataset(self, name: str) -> Dataset:
        if name not in self._sets:
            cached = self.config.cache_features
            self._sets[name] = CachedRows(self._cache(name)) if cached else RawRows(self.splits[name])
        return self._sets[name]

    def loader(self, name: str) -> DataLoader:
        """Prompts of split ``name`` in dataset order (validation, final evaluation), this rank's share."""
        dataset = self.dataset(name)
        return DataLoader(dataset,
                          batch_sampler=RankBatches(SequentialSampler(dataset), self.config.batch_size, *self._rank()),
                          num_workers=self.config.num_workers, collate_fn=self.collate)

    @property
    def collate(self):
        return collate_cached if self.config.cache_features else collate_raw

    def train_dataloader(self) -> DataLoader:
        c = self.config
        dataset = self.dataset(c.train_split)
        return ResumableLoader(dataset, seed=c.seed, batch_size=c.batch_size, rank=self._rank()[0],
                               world_size=self._rank()[1], num_workers=c.num_workers, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.config.val_split) if self.config.val_split is not None else []
