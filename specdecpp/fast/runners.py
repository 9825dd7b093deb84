"""The static runners' shared base (:class:`StaticModel`) and the one-row runner
(:class:`StaticRunner`): ``ModelRunner``'s interface over a :class:`~specdecpp.fast.kv.StaticKV`, each
forward padded to a width bucket and run through that bucket's step, eager, compiled
(:mod:`~specdecpp.fast.compiling`) or captured (:mod:`~specdecpp.fast.graphs`) as ``fast`` says.
A forward wider than the largest bucket runs unpadded and uncompiled (said once per model)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch

from ..core.attention import attention_swap
from ..core.compat import cache_kwargs
from ..models.runner import HiddenHook
from . import compiling, torch_internals
from .buckets import (
    BUCKETED_BACKENDS,
    COMPILING_BACKENDS,
    DEFAULT_MAX_LEN,
    GRAPH_BACKENDS,
    TARGET_BUCKETS,
    check_buckets,
    check_fast,
)
from .graphs import graph_outputs, lease_graph_set
from .kv import StaticKV, check_keep
from .step import model_steps, static_step

log = logging.getLogger(__name__)


class StaticModel(HiddenHook):
    """What both static runners share: the model as its decoder and output layer, the name the
    decoder takes its cache under, ``max_len``, the width ``buckets``, the model's process-wide
    steps (:func:`model_steps`) and the mask's fill value. The hidden state comes from the step
    itself, so the context manager has no hook to install."""

    def __init__(self, model, vocab: int, want_hidden: bool, fast: str, max_len: int | None,
                 buckets: tuple[int, ...], cover: bool = True) -> None:
        self.device = next(model.parameters()).device
        if fast is None:
            raise ValueError(f"{type(self).__name__}: fast must be 'static', 'compile' or 'graphs' "
                             "(fast=None is the eager runner)")
        check_fast(type(self).__name__, fast, self.device, model)
        self.model, self.vocab, self.want_hidden, self.fast = model, vocab, want_hidden, fast
        self.buckets = check_buckets(buckets)
        limit = int(getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_LEN)
        self.max_len = int(max_len) if max_len is not None else min(DEFAULT_MAX_LEN, limit)
        if self.max_len < 1:
            raise ValueError(f"max_len must be positive, got {max_len}")
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.cache_arg = next(iter(cache_kwargs(self.decoder, None)))
        self.dtype = next(model.parameters()).dtype
        self.steps = model_steps(model)
        self.compile_options: dict | None = None  # fast="compile": None = COMPILE_OPTIONS when a bucket compiles
        self.mask_min = torch.finfo(self.dtype).min
        # the public timing hook: meter(part, fn, *args) calls fn(*args), returns its result and may time it
        # as part ("mask": a forward's mask and inputs; "step": its forward step, compiled or eager); None: untimed
        self.meter = None
        # a bucket that has not compiled yet runs in a compiled larger one until it pays (_cover); warm_up turns it off
        self.cover = cover and fast in COMPILING_BACKENDS
        # around each forward: the CPU's attention in place of sdpa (core.attention.attention_swap), the way
        # decided once here, the cheapest this config allows (torch_internals: config_dict; a partial:
        # forward_at's closures hold no runner)
        self.attention = torch_internals.swap_by_dict(attention_swap(model.config, self.device), model.config)

    def _cover(self, size: int, width: int, batch: int | None = None) -> tuple[int, int | None, tuple | None]:
        """The bucket a forward that needs bucket ``width`` (and ``batch``: a batch runner's) of
        cache ``size`` runs in, and the key it rents for: its own if compiled, else the smallest
        compiled bucket that holds it (a batch bucket within the buffer rows) while the forwards it
        served there took less time in all than that bucket took to compile (ski rental; docs/engine.md,
        "Buckets that have not compiled yet"), else its own, compiled on this forward."""
        done = self.steps.compile_seconds
        key = (width, size) if batch is None else (width, size, batch)
        if key in done:
            return width, batch, None
        holders = [k for k in done if len(k) == len(key) and k[1] == size and k[0] >= width and k[0] in self.buckets
                   and (batch is None or (batch <= k[2] <= self.capacity and k[2] in self.batch_buckets))]
        if not holders:
            return width, batch, None
        cover = min(holders, key=lambda k: (k[0] * (1 if batch is None else k[2]), k[0]))  # the fewest rows x columns
        if self.steps.rent.get(key, 0.0) >= done[cover]:
            return width, batch, None
        if key not in self.steps.rent:
            log.info("%s: forwards of bucket %s run in the compiled bucket %s until they have taken its compile "
                     "time", type(self.model).__name__, key, cover)
        return cover[0], None if batch is None else cover[2], key

    def _pay_rent(self, key: tuple, t0: float) -> None:
        """Count the time since ``t0`` (a forward run in a larger bucket for ``key``) towards ``key``'s rent."""
        self.steps.rent[key] = self.steps.rent.get(key, 0.0) + time.perf_counter() - t0

    def _bucket(self, n: int, buckets: tuple[int, ...], what: str) -> int:
        """The smallest of ``buckets`` that holds ``n`` (``what``: "tokens" or "rows"), or ``n``
        itself beyond the largest, said once per model (such forwards run unpadded and uncompiled)."""
        fit = next((b for b in buckets if b >= n), n)
        flag = "warned_wide" if what == "tokens" else "warned_rows"
        if fit == n > buckets[-1] and not getattr(self.steps, flag):
            setattr(self.steps, flag, True)
            log.warning("%s: a forward of %d %s is wider than the largest bucket (%d); such forwards run unpadded "
                        "and uncompiled (said once per model)", type(self.model).__name__, n, what, buckets[-1])
        return fit


class StaticRunner(StaticModel):
    """One model over a :class:`~specdecpp.fast.kv.StaticKV` of ``max_len`` tokens, forwards padded to
    ``buckets`` (docs/engine.md, "Buckets"). ``fast`` is ``"static"`` (eager), ``"compile"`` or
    ``"graphs"``. Same interface as :class:`ModelRunner`."""

    def __init__(self, model, vocab: int, want_hidden: bool, *, fast: str = "static", max_len: int | None = None,
                 buckets: tuple[int, ...] = TARGET_BUCKETS, cover: bool = True) -> None:
        super().__init__(model, vocab, want_hidden, fast, max_len, buckets, cover)
        size = self.max_len + self.buckets[-1]
        buffers, self._graph_steps = None, {}
        if fast in GRAPH_BACKENDS:  # the buffers the captured graphs of this model and size read (static addresses)
            self.graph_set = lease_graph_set(model, self, 1, size, self.dtype, self.device)
            buffers = (self.graph_set.keys, self.graph_set.values)
        self.cache = StaticKV(model.config, size, self.dtype, self.device, buffers)
        # the step every bucket runs (and compiles), and its compiled name's stem: a subclass may step otherwise
        # (specdecpp.fast.features: one that also returns the target's fused features); what a step returns after
        # the logits and the hidden state is kept, cut to the forward's real rows, in ``extras``
        self.step_fn, self.step_name = static_step, "static_step"
        self.extras: tuple[torch.Tensor, ...] = ()

    @property
    def length(self) -> int:
        return self.cache.length

    def feed(self, ids: torch.Tensor, n_logits: int = 1, position_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None):
        """As :meth:`ModelRunner.feed`: append ``ids`` [n]; return logits [n_logits, V] and the
        hidden state [n_logits, H] (None without ``want_hidden``). ``position_ids`` [n] and a
        boolean ``attention_mask`` [n, length + n] serve a token tree."""
        n, start = ids.shape[0], self.length
        if not 1 <= n_logits <= n:
            raise ValueError(f"n_logits must lie in [1, {n}] for {n} tokens, got {n_logits}")
        if start + n > self.max_len:
            raise ValueError(f"the static cache holds max_len={self.max_len} tokens: {start} cached + {n} fed does not "
                             "fit; build the runner with a larger max_len")
        width = self._bucket(n, self.buckets, "tokens")
        renting = None
        if self.cover and width in self.buckets and (width, self.cache.size) not in self.steps.compile_seconds:
            width, _, renting = self._cover(self.cache.size, width)
        pad, meter = width - n, self.meter
        if position_ids is None and attention_mask is None:  # a chain's forward: inputs kept for the process
            slots, position_ids, mask = (self.chain_inputs(start, width) if meter is None
                                         else meter("mask", self.chain_inputs, start, width))
        else:
            slots = torch.arange(start, start + width, device=ids.device)
            if position_ids is None:  # a tensor of its own: an alias of slots would be another graph (a recompile)
                position_ids = torch.arange(start, start + width, device=ids.device)
            elif pad:
                position_ids = torch.cat([position_ids, position_ids[-1:].expand(pad)])
            mask = (self._mask(n, width, attention_mask) if meter is None
                    else meter("mask", self._mask, n, width, attention_mask))
        if pad:
            ids = torch.cat([ids, ids[-1:].expand(pad)])
        # inference only: one graph whatever the caller's grad mode, and freezing needs it; a decoder's generate
        # runs without autograd already, and then no torch context is entered (one operation fewer a feed)
        t0 = time.perf_counter() if renting else 0.0
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext(), self.attention():
            step, args = self._step(width), (self.decoder, self.head, self.cache_arg, self.cache, ids, position_ids,
                                             slots, mask)
            logits, hidden, *extras = step(*args) if meter is None else meter("step", step, *args)
        if extras:
            self.extras = tuple(e[:n] for e in extras)
        if renting:
            self._pay_rent(renting, t0)
        self.cache.length = start + n
        if n_logits < width:  # the padding rows, and rows not asked for, dropped
            rows = slice(n - n_logits, n)
            logits, hidden = logits[rows], hidden[rows] if self.want_hidden else None
        elif not self.want_hidden:
            hidden = None
        if logits.shape[-1] != self.vocab:
            logits = logits[:, : self.vocab]
        return graph_outputs(self.fast in GRAPH_BACKENDS and width in self.buckets, logits, hidden)

    def chain_inputs(self, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chain's forward of ``width`` tokens at ``start``: its cache slots, its positions (the
        same values, a tensor of its own) and its mask (:meth:`_mask`), made once per (cache size,
        start, width) for the process and kept on the model (:func:`model_steps`: three small tensors
        per key a call has used, up to max_len x the buckets). On a CPU every small tensor operation
        between two forwards costs tens of microseconds more than warm, since each forward flushes
        the caches (docs/engine.md, "The loop on a CPU: cold caches"); a feed makes five fewer. The
        steps only read them (a graph backend copies them into its own inputs)."""
        key = (self.cache.size, self.dtype, self.device, start, width)
        made = self.steps.chain_inputs.get(key)
        if made is None:
            made = self.steps.chain_inputs[key] = (torch.arange(start, start + width, device=self.device),
                                                   torch.arange(start, start + width, device=self.device),
                                                   self.causal_mask()[start : start + width][None, None])
        return made

    def _mask(self, n: int, width: int, allowed: torch.Tensor | None) -> torch.Tensor:
        """The additive mask [1, 1, width, size]. A chain's forward (``allowed`` None): rows
        [length, length + width) of one causal mask per size kept for the process, a view (no
        work per forward): every row sees the slots up to its own, so no real row sees a padding
        slot or anything above length + n, and padding rows (whose outputs are dropped) see the
        real ones too. A tree's (``allowed`` [n, length + n]): real rows as ``allowed`` says,
        padding rows only themselves, nobody a slot at or above length + n otherwise."""
        start, device = self.length, self.cache.keys[0].device
        if allowed is None:
            return self.chain_inputs(start, width)[2]
        grid = torch.zeros(width, self.cache.size, dtype=torch.bool, device=device)
        if allowed.shape != (n, start + n):
            raise ValueError(f"attention_mask must be [n, cached + n] = [{n}, {start + n}], got {tuple(allowed.shape)}")
        grid[:n, : start + n] = allowed
        pads = torch.arange(n, width, device=device)
        grid[pads, start + pads] = True
        mask = torch.zeros(grid.shape, dtype=self.cache.keys[0].dtype, device=device)
        return mask.masked_fill_(~grid, self.mask_min)[None, None]

    def causal_mask(self) -> torch.Tensor:
        """The additive causal mask [size, size] of this cache's size, one per (size, dtype, device)
        kept for the process: row i sees the slots up to i."""
        size, device = self.cache.size, self.cache.keys[0].device
        causal = self.steps.causal.get((size, self.dtype, device))
        if causal is None:
            seen = torch.ones(size, size, dtype=torch.bool, device=device).tril_()
            causal = torch.zeros(size, size, dtype=self.dtype, device=device).masked_fill_(~seen, self.mask_min)
            self.steps.causal[(size, self.dtype, device)] = causal
        return causal

    def _step(self, width: int):
        """The step for a forward of ``width`` tokens: eager, or this bucket's compiled or captured step."""
        if self.fast not in BUCKETED_BACKENDS or width not in self.buckets:
            return self.step_fn
        graph_step = self._graph_steps.get(width)
        if graph_step is not None:
            return graph_step
        step = self.plain_step(width)
        if self.fast in GRAPH_BACKENDS:  # one callable per bucket (as the compiled steps: meters key on it)
            key, name = (width, self.cache.size), f"static_step_w{width}_s{self.cache.size}"
            step = self._graph_steps[width] = functools.partial(self.graph_set.run, self.steps, (self.fast, *key), name,
                                                                step)
        return step

    def plain_step(self, width: int):
        """A bucket's step as a graph captures it: the compiled step under ``"compile"`` and
        ``"compile-graphs"``, else the eager :func:`static_step`."""
        if self.fast not in ("compile", "compile-graphs") or width not in self.buckets:
            return self.step_fn
        key, name = (width, self.cache.size), f"{self.step_name}_w{width}_s{self.cache.size}"
        return compiling.compiled_step(self.model, self.step_fn, key, name, self.steps, self.compile_options)

    def forward_at(self, width: int):
        """A chain forward of one bucket's width, as a captured round runs it
        (specdecpp/decoders/captured.py): a callable ``(ids [width], start) -> (logits [width, V], hidden
        [width, H])`` writing slots ``start`` .. ``start + width - 1``, ``start`` a 0-d long tensor on the
        device, so nothing is read on the host; ``length`` is left to the caller. It holds this
        runner's buffers (under the graph backends, its leased set's) and no reference to the runner."""
        if width not in self.buckets:
            raise ValueError(f"forward_at: width {width} is not one of the buckets {self.buckets}")
        cache = StaticKV(self.model.config, self.cache.size, self.dtype, self.device,
                         (self.cache.keys, self.cache.values))
        fixed, step, causal = ((self.decoder, self.head, self.cache_arg, cache), self.plain_step(width),
                               self.causal_mask())

        attention = self.attention

        def forward(ids: torch.Tensor, start: torch.Tensor):
            offsets = torch.arange(width, device=ids.device)
            slots, positions = start + offsets, start + offsets  # two tensors (an alias would be another graph)
            with attention():
                return step(*fixed, ids, positions, slots, causal.index_select(0, slots)[None, None])

        return forward

    def kept_cache(self) -> StaticKV:
        """The cache a call hands out (``return_caches=True``): this runner's own, or under the graph
        backends a copy of it, since its buffers are a graph set's, which the next call leases."""
        if self.fast not in GRAPH_BACKENDS:
            return self.cache
        cache = self.cache
        kept = StaticKV(self.model.config, cache.size, self.dtype, self.device,
                        ([k.clone() for k in cache.keys], [v.clone() for v in cache.values]))
        kept.length = cache.length
        return kept

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (no-op if fewer are cached): a position move."""
        if length < 0:
            raise ValueError(f"rollback length must be >= 0, got {length}")
        self.cache.length = min(self.length, int(length))

    def compact(self, keep) -> None:
        """As :meth:`ModelRunner.compact`: keep only the cached positions ``keep`` (strictly
        increasing), in that order, by an index copy inside each buffer."""
        self.cache.compact(check_keep(keep, self.length))
