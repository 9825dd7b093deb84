"""The static batch runner (:class:`StaticBatchRunner`): the eager ``BatchRunner``'s interface over
buffers [R, kv_heads, size, head_dim] per layer. Row b lives in buffer row ``slot_of[b]`` and holds
``lengths[b]`` tokens; a forward runs over the first B buffer rows (B the batch bucket that holds the
highest occupied one) through a :class:`~specdecpp.fast.kv.RowWindow`, so a compiled step depends on
(B, W, size) and not on the runner's capacity (docs/engine.md, "Batches")."""

from __future__ import annotations

import time

import torch

from ..core.hooks import new_cache
from . import compiling
from .buckets import BATCH_BUCKETS, BUCKETED_BACKENDS, GRAPH_BACKENDS, TARGET_BUCKETS, check_buckets
from .graphs import graph_outputs, lease_graph_set
from .kv import RowWindow, kv_buffers
from .runners import StaticModel
from .step import batch_step


class StaticBatchRunner(StaticModel):
    """One model over a static cache of per-row lengths, with the interface of the eager
    ``specdecpp.decoders.batch.BatchRunner`` (``feed(chunks, n_logits)``, ``rollback(lengths)``,
    ``compact()``, ``select(keep)``, ``add_rows(prefixes)``, ``row_cache(b)``, ``rows``,
    ``lengths``, ``width``; docs/engine.md, "Batches", says how it works). ``rows``: the most rows
    expected at once (more grow the buffers, a copy); ``max_len``: the tokens a row can hold;
    ``buckets``: the width buckets, ``batch_buckets`` the batch buckets; ``cover=False``: no forward
    runs in a compiled larger bucket than its own (:class:`CallRunners`)."""

    def __init__(self, model, vocab: int, want_hidden: bool, *, fast: str = "static", max_len: int | None = None,
                 buckets: tuple[int, ...] = TARGET_BUCKETS, batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
                 rows: int = 1, cover: bool = True) -> None:
        super().__init__(model, vocab, want_hidden, fast, max_len, buckets, cover)
        self.batch_buckets = check_buckets(batch_buckets)
        self.size = self.max_len + self.buckets[-1]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self._grow(max(1, int(rows)))
        self.lengths: list[int] = []  # row b holds lengths[b] tokens, in buffer row slot_of[b]
        self.slot_of: list[int] = []
        self.n_compactions = 0  # BatchRunner's counter: no compaction is ever needed here
        # the step every forward runs (a feature pair's target: one that also returns its features, kept in
        # ``extras``, row b's the batch's row b, a prefill's row i prefix i's; fast/features.py)
        self.step_fn, self.step_name = batch_step, "batch_step"
        self.extras: tuple[torch.Tensor, ...] = ()
        self.n_moved_rows = 0  # rows copied to a lower buffer row so that the batch bucket shrinks

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """The cache columns every forward attends over (each row's slots, the masked ones too)."""
        return self.size

    def _grow(self, rows: int) -> None:
        """Buffers for at least ``rows`` rows (a batch bucket's worth), the rows held copied over."""
        capacity = next((b for b in self.batch_buckets if b >= rows), rows)
        if capacity <= self.capacity:
            return
        if self.fast in GRAPH_BACKENDS:  # a leased set of that many rows (static addresses); the old one is released
            old_set = getattr(self, "graph_set", None)
            self.graph_set = lease_graph_set(self.model, self, capacity, self.size, self.dtype, self.device)
            keys, values = self.graph_set.keys, self.graph_set.values
            if old_set is not None:
                old_set.owner = None
        else:
            keys, values = kv_buffers(self.model.config, capacity, self.size, self.dtype, self.device)
        for new, old in zip((*keys, *values), (*self.keys, *self.values), strict=False):
            new[: self.capacity] = old
        self.keys, self.values, self.capacity = keys, values, capacity

    def _check_room(self, added: list[int]) -> None:
        over = [b for b, n in enumerate(added) if self.lengths[b] + n > self.max_len]
        if over:
            b = over[0]
            raise ValueError(f"the static cache holds max_len={self.max_len} tokens per row: row {b} has "
                             f"{self.lengths[b]} cached + {added[b]} fed; build the runner with a larger max_len")

    def feed(self, chunks: list[torch.Tensor], n_logits: int | None = None):
        """As ``BatchRunner.feed``: append ``chunks[b]`` (1-D, possibly empty) to row b in one
        forward of W = the longest chunk (padded to a (batch, width) bucket); returns logits [B, W',
        V] and hidden [B, W', H] (or None) of the last W' = ``n_logits`` (None: all W) columns, row
        b's real tokens its first ``len(chunks[b])`` columns (the others filler)."""
        if len(chunks) != self.rows:
            raise ValueError(f"StaticBatchRunner.feed: {len(chunks)} chunks for {self.rows} rows")
        m = [int(c.shape[0]) for c in chunks]
        width = max(m, default=0)
        if width == 0:
            raise ValueError("StaticBatchRunner.feed: every chunk is empty; feed at least one token")
        self._check_room(m)
        batch = self._bucket(max(self.slot_of) + 1, self.batch_buckets, "rows")
        padded = self._bucket(width, self.buckets, "tokens")
        compiled = self.fast in BUCKETED_BACKENDS and batch in self.batch_buckets and padded in self.buckets
        renting = None
        if compiled and self.cover:
            padded, batch, renting = self._cover(self.size, padded, batch)
        ids = torch.zeros((batch, padded), dtype=torch.long, device=self.device)
        lengths, real = [0] * batch, [0] * batch
        for b, (slot, chunk) in enumerate(zip(self.slot_of, chunks, strict=True)):
            lengths[slot], real[slot] = self.lengths[b], m[b]
            if m[b]:
                ids[slot, : m[b]] = chunk
        t0 = time.perf_counter() if renting else 0.0
        logits, hidden, *extras = self._forward(ids, lengths, real, None, compiled)
        if renting:
            self._pay_rent(renting, t0)
        self.lengths = [n + k for n, k in zip(self.lengths, m, strict=True)]
        keep = width if n_logits is None else min(n_logits, width)
        if self.slot_of != list(range(self.rows)):
            order = torch.tensor(self.slot_of, device=self.device)
            logits, hidden = logits.index_select(0, order), hidden.index_select(0, order)
            extras = [e.index_select(0, order) for e in extras]
        self.extras = tuple(e[: self.rows, :width] for e in extras)
        logits, hidden = (logits[: self.rows, width - keep : width, : self.vocab],
                          hidden[: self.rows, width - keep : width])
        return graph_outputs(compiled and self.fast in GRAPH_BACKENDS, logits, hidden if self.want_hidden else None)

    def _forward(self, ids: torch.Tensor, lengths: list[int], real: list[int], rows: torch.Tensor | None,
                 compiled: bool, span: int | None = None):
        """One step over ``ids`` [B, W]: forward row i holds ``lengths[i]`` tokens and feeds
        ``real[i]`` of its W columns (the others are padding, written above its length, seeing only
        themselves); ``rows`` as :class:`RowWindow` takes it. ``span`` (with ``rows``): the forward
        attends over the first ``span`` slots only, every slot it writes and reads lying below it
        (a prefill from length 0: its width), instead of the whole buffer."""
        batch, width = ids.shape
        start = torch.tensor(lengths, device=self.device)[:, None]
        columns = torch.arange(width, device=self.device)[None]
        slots = (start + columns).clamp_(max=self.size - 1)  # only padding reaches the end (max_len is checked)
        positions = start + columns  # a tensor of its own: an alias of slots would be another graph
        is_real = columns < torch.tensor(real, device=self.device)[:, None]
        cache_cols = torch.arange(self.size if span is None else span, device=self.device)
        grid = (cache_cols <= slots[..., None]) & (is_real[..., None] | (cache_cols >= slots[..., None]))
        mask = torch.zeros(grid.shape, dtype=self.dtype, device=self.device).masked_fill_(~grid, self.mask_min)[:, None]
        if rows is None:
            window = RowWindow([k[:batch] for k in self.keys], [v[:batch] for v in self.values])
        else:
            window = RowWindow(self.keys, self.values, rows, span)
        step, key, name = self.step_fn, (width, self.size, batch), f"{self.step_name}_b{batch}_w{width}_s{self.size}"
        if compiled and self.fast != "graphs":  # compile, compile-graphs: the bucket's compiled step
            step = compiling.compiled_step(self.model, self.step_fn, key, name, self.steps, self.compile_options)
        with self.attention():
            if compiled and self.fast in GRAPH_BACKENDS:
                return self.graph_set.run(self.steps, (self.fast, *key), name, step, self.decoder, self.head,
                                          self.cache_arg, window, ids, positions, slots, mask)
            with torch.no_grad():  # inference only; grad mode is part of a compiled step's guards
                return step(self.decoder, self.head, self.cache_arg, window, ids, positions, slots, mask)

    def rollback(self, lengths: list[int]) -> None:
        """Keep the first ``lengths[b]`` tokens of row b (no-op for rows with fewer cached): the
        lengths move, nothing is copied."""
        if len(lengths) != self.rows:
            raise ValueError(f"StaticBatchRunner.rollback: {len(lengths)} lengths for {self.rows} rows")
        if any(int(n) < 0 for n in lengths):
            raise ValueError(f"rollback lengths must be >= 0, got {list(lengths)}")
        self.lengths = [min(n, int(keep)) for n, keep in zip(self.lengths, lengths, strict=True)]

    def compact(self) -> None:
        """Nothing to do: a rollback leaves no holes (``BatchRunner.compact``'s counterpart)."""

    def select(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (in that order); the others' buffer rows become free. When the
        rows left fit a smaller batch bucket than the buffer rows they occupy, the rows above it
        move down into free buffer rows (a copy of those rows only)."""
        keep = [int(b) for b in keep]
        if any(not 0 <= b < self.rows for b in keep) or len(set(keep)) != len(keep):
            raise ValueError(f"select: keep must name distinct rows in [0, {self.rows}), got {keep}")
        self.slot_of = [self.slot_of[b] for b in keep]
        self.lengths = [self.lengths[b] for b in keep]
        if not keep:
            return
        fit = next((b for b in self.batch_buckets if b >= len(keep)), len(keep))
        high = [b for b, slot in enumerate(self.slot_of) if slot >= fit]
        if high and self._bucket(max(self.slot_of) + 1, self.batch_buckets, "rows") > fit:
            free = sorted(set(range(fit)) - set(self.slot_of))
            src = torch.tensor([self.slot_of[b] for b in high], device=self.device)
            dst = torch.tensor(free[: len(high)], device=self.device)
            for buf in (*self.keys, *self.values):
                buf.index_copy_(0, dst, buf.index_select(0, src))
            for b, slot in zip(high, free, strict=False):
                self.slot_of[b] = slot
            self.n_moved_rows += len(high)

    def add_rows(self, prefixes: list[torch.Tensor]) -> None:
        """New rows at the end of the batch in the lowest free buffer rows, their ``prefixes``
        prefilled in one eager forward of their own (the rows already here run nothing), which
        attends over the longest prefix's slots only, not the whole buffer."""
        m = [int(p.shape[0]) for p in prefixes]
        if any(n > self.max_len for n in m):
            raise ValueError(f"the static cache holds max_len={self.max_len} tokens per row: a prefix of {max(m)} "
                             "does not fit; build the runner with a larger max_len")
        self._grow(self.rows + len(prefixes))
        slots = sorted(set(range(self.capacity)) - set(self.slot_of))[: len(prefixes)]
        fed = [i for i, n in enumerate(m) if n]
        if fed:
            width = max(m)
            ids = torch.zeros((len(fed), width), dtype=torch.long, device=self.device)
            for row, i in enumerate(fed):
                ids[row, : m[i]] = prefixes[i]
            rows = torch.tensor([slots[i] for i in fed], device=self.device)
            _, _, *extras = self._forward(ids, [0] * len(fed), [m[i] for i in fed], rows, compiled=False, span=width)
            index = torch.tensor(fed, device=self.device)  # row i: prefix i's (an empty prefix's: zeros)
            self.extras = tuple(e.new_zeros((len(prefixes), *e.shape[1:])).index_copy_(0, index, e) for e in extras)
        self.slot_of += slots
        self.lengths += m

    def row_cache(self, b: int):
        """Row b's cached tokens alone, as a fresh transformers cache [1, heads, lengths[b], d]."""
        cache, slot, length = new_cache(self.model), self.slot_of[b], self.lengths[b]
        for i, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            cache.layers[i].update(keys[slot : slot + 1, :, :length].clone(),
                                   values[slot : slot + 1, :, :length].clone())
        return cache
