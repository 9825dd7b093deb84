"""Batches for head training: cached draft features, or raw rows mixed on the fly.

A batch is a fixed group of prompts (``data.batch_size`` of them), so the loss normalisation runs
over the same Y-positions whichever way the features are obtained:
- cached: ``{"hidden": [M, H], "labels": [M]}``, the M Y-positions of the batch's prompts;
- raw: ``{"row", "prompt_ids", "target_ids", "draft_ids", "p_acc"}`` lists; the module mixes the
  tokens (mask of the current epoch or the fixed one) and runs the draft.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, SequentialSampler

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


class HeadDataModule(L.LightningDataModule):
    """Train/validation loaders (and a loader per split for the final evaluation). ``draft`` is the
    draft model or a function that loads it (called only where the draft must run)."""

    def __init__(self, splits, *, train_split: str, val_split: str | None, draft, draft_ref: str,
                 batch_size: int, num_workers: int, mix_ratio: float, mix_seed: int, seed: int,
                 cache_features: bool, cache_dir: str, cache_dtype: str, feature_batch_size: int,
                 feature_spec: dict | None = None, feature_size: int | None = None,
                 draft_precision: str = "float32") -> None:
        super().__init__()
        for name in (train_split, val_split):
            if name is not None and name not in splits:
                raise ValueError(f"dataset has no split {name!r} (it has {list(splits)}); set "
                                 "data.train_split / data.val_split (null for no validation)")
        self.splits, self.train_split, self.val_split = splits, train_split, val_split
        self.draft, self.draft_ref = draft, draft_ref
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.mix_ratio, self.mix_seed = mix_ratio, mix_seed
        self.cache_features, self.cache_dir, self.cache_dtype = cache_features, cache_dir, cache_dtype
        self.feature_batch_size = feature_batch_size
        self.feature_spec, self.feature_size = feature_spec, feature_size  # the head's (see specdecpp.stopping.head)
        self.draft_precision = draft_precision  # the dtype the draft computes its features in (cache key)
        self._sets: dict[str, Dataset] = {}

    def _rank(self) -> tuple[int, int]:
        """(rank, world size) under the trainer: every global batch is split over the ranks here
        (trainer.use_distributed_sampler=false, conf/trainer/ddp.yaml), not by Lightning."""
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def prepare_data(self) -> None:
        """Build the feature caches on one process per node (Lightning calls this on local rank 0,
        then lets the other ranks in): they open the finished caches without loading the draft."""
        if self.cache_features:
            for name in self.splits:
                self._cache(name)

    def _cache(self, name: str):
        return feature_cache(self.splits[name], name, self.draft, self.draft_ref, self.cache_dir, self.mix_ratio,
                             self.mix_seed, self.cache_dtype, self.feature_batch_size, self.feature_spec,
                             self.feature_size, self.draft_precision)

    def dataset(self, name: str) -> Dataset:
        if name not in self._sets:
            self._sets[name] = CachedRows(self._cache(name)) if self.cache_features else RawRows(self.splits[name])
        return self._sets[name]

    def loader(self, name: str) -> DataLoader:
        """Prompts of split ``name`` in dataset order (validation, final evaluation), this rank's share."""
        dataset = self.dataset(name)
        return DataLoader(dataset,
                          batch_sampler=RankBatches(SequentialSampler(dataset), self.batch_size, *self._rank()),
                          num_workers=self.num_workers, collate_fn=self.collate)

    @property
    def collate(self):
        return collate_cached if self.cache_features else collate_raw

    def train_dataloader(self) -> DataLoader:
        dataset = self.dataset(self.train_split)
        return ResumableLoader(dataset, seed=self.seed, batch_size=self.batch_size, rank=self._rank()[0],
                               world_size=self._rank()[1], num_workers=self.num_workers, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.val_split) if self.val_split is not None else []
