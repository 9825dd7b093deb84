"""Per-row batches of a feature-draft pair (``generate_batch`` with a
:class:`~specdecpp.models.feature_draft.FeatureDraft`; docs/feature_draft.md, "Per-row batches").

The two runners keep :class:`~specdecpp.decoders.batch.BatchRunner`'s layout and contract (one cache
over the batch, a forward appends the same W columns to every row, a row's holes are masked, rollback
masks a row's newest columns, compaction and leaving rows as there) and add what the single-sequence
feature runners (:mod:`specdecpp.models.feature_runner`) add to a chain:

- :class:`BatchFeatureTargetRunner`: the target's batch runner; each forward's aux-layer inputs
  (captured by forward pre-hooks, no extra forward) of row b's real tokens go to row b's
  :class:`~specdecpp.models.feature_runner.FeatureStore`, which follows the row's rollback and its
  leaving (:class:`RowStores`, shared with the draft's runner);
- :class:`BatchFeatureDraftRunner`: the draft's batch runner over one
  :class:`~specdecpp.models.feature_draft.FeatureDraftCache` of [B, kv_heads, T, head_dim]. Entry j of a
  row reads its target feature g_j where the row's store holds it, else (a drafted position) the
  draft's own output at entry j - 1, which an earlier forward computed: one drafted entry per row per
  forward, as the batch drafter feeds them. x_0 has no entry: it takes a hole column, so that output
  column i is chunk token i's in every row. A rollback keeps a row's entries made from the target's
  features (the kept tokens are fed again over the target's features, as in the chain).

A row joins with its prefix prefilled on both models, so unlike a chain call (whose first round is the
target's prefill) its first round drafts; a one-token prompt's row waits one round (:meth:`can_draft`).
"""

from __future__ import annotations

import torch

from ..models.feature_draft import FeatureDraft, FeatureDraftCache
from ..models.feature_runner import AuxHidden, FeatureStore, KeepsRowFeatures, RowStores
from .batch import COMPACT_AT, BatchRunner


class BatchFeatureTargetRunner(KeepsRowFeatures, BatchRunner):
    """The target's :class:`BatchRunner` that also keeps every row's fused features (module docstring),
    captured by forward pre-hooks around each forward."""

    def __init__(self, model, vocab: int, want_hidden: bool, layers: list[int], stores: RowStores) -> None:
        super().__init__(model, vocab, want_hidden)
        self.aux, self.stores = AuxHidden(model, layers), stores

    def _fused_of(self) -> torch.Tensor:
        return self.aux.fused()

    def feed(self, chunks: list[torch.Tensor], n_logits: int | None = None):
        with self.aux:
            return super().feed(chunks, n_logits)

    def add_rows(self, prefixes: list[torch.Tensor]) -> None:
        """As :meth:`BatchRunner.add_rows` (the prefill runs on this model, so the hooks see it)."""
        with self.aux:
            super().add_rows(prefixes)


class BatchFeatureDraftRunner:
    """The feature draft's batch runner (module docstring): ``feed(chunks)`` appends ``chunks[b]`` (the
    tokens after ``lengths[b]``) to row b in one draft forward and returns logits [B, W', vocab]
    (exactly -inf off the draft's vocabulary) and, with ``want_hidden``, the output states [B, W', H]
    of the last W' = ``n_logits`` columns, column i of a row being its chunk token i's."""

    def __init__(self, model: FeatureDraft, vocab: int, want_hidden: bool, stores: RowStores,
                 offset: int = 0) -> None:
        """``offset``: row b reads ``stores.rows[offset + b]`` (a joining block's prefill)."""
        self.model, self.vocab, self.want_hidden, self.stores, self.offset = model, vocab, want_hidden, stores, offset
        self.device = model.device
        self.cache = model.new_cache()
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [B, T]: the column is an entry
        self.read: list[int] = []  # tokens read per row (x_0 included; entries = read - 1)
        self.from_target: list[int] = []  # a row's leading entries made from the target's features
        self.last: list[int | None] = []  # the entry whose output state is in last_hidden, per row
        self.last_hidden = torch.zeros((0, model.hidden_size), dtype=model.dtype, device=self.device)
        self.n_compactions = 0

    def __enter__(self) -> BatchFeatureDraftRunner:
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def rows(self) -> int:
        return len(self.read)

    @property
    def lengths(self) -> list[int]:
        return list(self.read)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def store(self, b: int) -> FeatureStore:
        return self.stores.rows[self.offset + b]

    def can_draft(self, b: int, start: int) -> bool:
        """Whether row b's draft can propose the token after its first ``start`` tokens: the target
        has kept the features of every entry before it (a one-token prompt's row: not before the
        target has read that token)."""
        return self.store(b).length >= start - 1 >= max(self.from_target[b], 1)

    def feed(self, chunks: list[torch.Tensor], n_logits: int | None = None):
        if len(chunks) != self.rows:
            raise ValueError(f"BatchFeatureDraftRunner.feed: {len(chunks)} chunks for {self.rows} rows")
        model, dev = self.model, self.device
        m = [int(c.shape[0]) for c in chunks]
        width = max(m)
        ids = torch.zeros((self.rows, width), dtype=torch.long, device=dev)
        real = torch.zeros((self.rows, width), dtype=torch.bool, device=dev)
        target_cols = torch.zeros((self.rows, width), dtype=torch.bool, device=dev)
        features = None
        positions = torch.zeros((self.rows, width), dtype=torch.long, device=dev)
        drafted: list[int] = []  # rows whose one real entry reads the draft's own output
        first_entry = []
        for b, c in enumerate(chunks):
            skip = int(self.read[b] == 0 and m[b] > 0)  # x_0: a hole column, no entry
            j = self.read[b] - 1 + skip  # the entry of the chunk's first token after a skip
            first_entry.append(j)
            ids[b, : m[b]] = c
            real[b, skip: m[b]] = True
            positions[b] = (j - skip + torch.arange(width, device=dev)).clamp(min=0)
            n_entries = m[b] - skip
            n_target = max(0, min(n_entries, self.store(b).length - j))
            if n_target:
                if j != self.from_target[b]:
                    raise RuntimeError(f"feature draft, row {b}: entry {j} reads a target feature after drafted "
                                       f"entries (from {self.from_target[b]})")
                if features is None:
                    features = torch.zeros((self.rows, width, len(model.aux_layers) * model.hidden_size),
                                           dtype=model.dtype, device=dev)
                features[b, skip: skip + n_target] = self.store(b).read(j, j + n_target)
                target_cols[b, skip: skip + n_target] = True
            if n_entries > n_target:
                if n_entries - n_target > 1 or n_target or self.last[b] != j - 1:
                    raise RuntimeError(f"feature draft, row {b}: entries {j + n_target}..{j + n_entries - 1} need the "
                                       f"draft's own outputs; a batch forward feeds one drafted entry per row, after "
                                       f"the entry whose output it has (last: {self.last[b]})")
                drafted.append(b)
        u = torch.zeros((self.rows, width, model.hidden_size), dtype=model.dtype, device=dev)
        if features is not None:
            u = torch.where(target_cols[..., None], model.project(features), u)
        for b in drafted:
            u[b, m[b] - 1] = self.last_hidden[b]
        old = self.width
        allowed = torch.cat([self.mask.bool()[:, None, :].expand(-1, width, -1),
                             torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None] & real[:, None, :]],
                            dim=2)
        allowed[:, :, old:] |= torch.eye(width, dtype=torch.bool, device=dev)  # a hole attends to itself (no NaN)
        if self.cache.length != old:
            raise RuntimeError(f"feature draft: the cache holds {self.cache.length} columns, the mask {old}")
        keep = width if n_logits is None else min(n_logits, width)
        out = model(ids, hidden=u, position_ids=positions, cache=self.cache, attention_mask=allowed, n_logits=keep)
        self.mask = torch.cat([self.mask, real.long()], dim=1)
        for b in range(self.rows):
            if m[b]:
                n_target = int(target_cols[b].sum())
                if n_target:
                    self.from_target[b] = first_entry[b] + n_target
                if real[b].any():
                    self.last[b] = first_entry[b] + int(real[b].sum()) - 1
                    self.last_hidden[b] = out.hidden[b, m[b] - 1]
                self.read[b] += m[b]
        hidden = out.hidden[:, width - keep:] if self.want_hidden else None
        return out.logits[..., : self.vocab], hidden

    def rollback(self, lengths: list[int]) -> None:
        """Keep at most ``lengths[b]`` tokens read of row b, and of its entries only those made from
        the target's features; compact once enough columns are holes in every row."""
        for b, n in enumerate(lengths):
            self.read[b] = min(self.read[b], n, self.from_target[b] + 1)
            self.from_target[b] = max(self.read[b] - 1, 0)
            if self.last[b] is not None and self.last[b] >= self.from_target[b]:
                self.last[b] = None
        if self.rows:
            keep = torch.tensor(self.from_target, device=self.device).unsqueeze(1)
            self.mask = self.mask * (self.mask.cumsum(1) <= keep)
        if self.rows and self.width - max(self.from_target) >= COMPACT_AT:
            self.compact()

    def _set_columns(self, index: torch.Tensor) -> None:
        """Every layer's keys and values gathered to the columns ``index`` [B, T'] per row."""
        for buffers in (self.cache.keys, self.cache.values):
            for i, buf in enumerate(buffers):
                idx = index[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3])
                buffers[i] = buf[:, :, : self.cache.length].gather(2, idx)
        self.cache.length = index.shape[1]

    def compact(self) -> None:
        """Move each row's entries to the right end and drop the columns no row needs."""
        width = max(self.from_target, default=0)
        order = torch.argsort(self.mask, dim=1, stable=True)[:, self.width - width:]
        self._set_columns(order)
        self.mask = self.mask.gather(1, order)
        self.n_compactions += 1

    def select(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (in that order)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for buffers in (self.cache.keys, self.cache.values):
            for i, buf in enumerate(buffers):
                buffers[i] = buf.index_select(0, index)
        self.mask = self.mask[index]
        self.last_hidden = self.last_hidden[index]
        for name in ("read", "from_target", "last"):
            setattr(self, name, [getattr(self, name)[b] for b in keep])
        if self.rows and self.width - max(self.from_target) >= COMPACT_AT:
            self.compact()

    def add_rows(self, prefixes: list[torch.Tensor]) -> None:
        """New rows at the end of the batch, their ``prefixes`` prefilled over the target's features
        (the target's runner joins them first) in one forward of their own, joined left-padded."""
        fresh = BatchFeatureDraftRunner(self.model, self.vocab, False, self.stores, self.offset + self.rows)
        n = len(prefixes)
        fresh.read, fresh.from_target, fresh.last = [0] * n, [0] * n, [None] * n
        fresh.mask = torch.zeros((n, 0), dtype=torch.long, device=self.device)
        fresh.last_hidden = self.last_hidden.new_zeros((n, self.model.hidden_size))
        if max(int(p.shape[0]) for p in prefixes) > 0:
            fresh.feed(prefixes, n_logits=1)
        width = max(self.width, fresh.width)
        cache = FeatureDraftCache()
        for attr in ("keys", "values"):
            mine, theirs = getattr(self.cache, attr), getattr(fresh.cache, attr)
            for layer in range(max(len(mine), len(theirs))):
                ref = (mine if layer < len(mine) else theirs)[layer]
                getattr(cache, attr).append(torch.cat([_left_padded(side, held, layer, width, ref) for side, held in
                                                       ((self, mine), (fresh, theirs))], dim=0))
        cache.length = width
        self.cache = cache
        self.mask = torch.cat([torch.cat([side.mask.new_zeros((side.rows, width - side.width)), side.mask], dim=1)
                               for side in (self, fresh)], dim=0)
        self.last_hidden = torch.cat([self.last_hidden, fresh.last_hidden])
        self.read += fresh.read
        self.from_target += fresh.from_target
        self.last += fresh.last

    def row_cache(self, b: int) -> FeatureDraftCache:
        """Row b's entries alone, as a fresh :class:`FeatureDraftCache` [1, kv_heads, entries, head_dim]."""
        columns = self.mask[b].nonzero().squeeze(1)
        cache = FeatureDraftCache()
        cache.keys = [k[b: b + 1, :, columns] for k in self.cache.keys]
        cache.values = [v[b: b + 1, :, columns] for v in self.cache.values]
        cache.length = int(columns.numel())
        return cache


def _left_padded(side: BatchFeatureDraftRunner, held: list, layer: int, width: int, ref: torch.Tensor) -> torch.Tensor:
    """``side``'s keys or values ``held`` of ``layer`` [rows, kv_heads, width, head_dim], zeros on the
    left (and all zeros where the side has written no layer yet, shaped after ``ref``)."""
    buf = held[layer][:, :, : side.width] if layer < len(held) else \
        ref.new_zeros((side.rows, ref.shape[1], side.width, ref.shape[3]))
    return torch.cat([buf.new_zeros((*buf.shape[:2], width - side.width, buf.shape[3])), buf], dim=2)


def batch_feature_runners(draft: FeatureDraft, target, static_target=None):
    """The factories ``(draft_runners, target_runners)`` of a feature pair's batch, each called as
    ``(model, vocab, want_hidden)``, sharing one :class:`RowStores`. ``static_target``: the target's
    runner on the fast path (:class:`~specdecpp.fast.features.StaticBatchFeatureTargetRunner` with
    its sizing bound, called as ``(model, vocab, want_hidden, layers, stores)``); None: the eager
    :class:`BatchFeatureTargetRunner`. The draft's runner is eager either way (a feature draft is no
    transformers model; its one layer is a few percent of a target forward)."""
    draft.check_target(target)
    stores, target_runner = RowStores(), static_target or BatchFeatureTargetRunner
    return (lambda model, vocab, want_hidden: BatchFeatureDraftRunner(model, vocab, want_hidden, stores),
            lambda model, vocab, want_hidden: target_runner(model, vocab, want_hidden, draft.aux_layers, stores))
