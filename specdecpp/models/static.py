"""A runner over a static KV cache that the project owns, the foundation of the fast path (issue 33).

:class:`StaticRunner` has :class:`~specdecpp.models.runner.ModelRunner`'s interface (``length``,
``feed``, ``rollback``, ``compact``, the context manager, ``.cache`` with ``get_seq_length()`` and
``layers[i].keys``/``.values``) and is chosen by one switch, :func:`new_runner`'s ``fast``:

- ``None``: the eager :class:`ModelRunner` over transformers' ``DynamicCache``.
- ``"static"``: :class:`StaticRunner`, every forward run eagerly (no compilation).
- ``"compile"``: the same forwards through ``torch.compile(fullgraph=True, dynamic=False)``, one
  compiled step per bucket, compiled lazily on its first use (inductor on CPU).
- ``"graphs"``: CUDA graphs per bucket; not built yet (refused with a ValueError).

What is owned: :class:`StaticKV`, a plain object (not a transformers ``Cache``) that Llama-style
models take as their cache. Per layer it preallocates keys and values [1, kv_heads, size, head_dim]
with ``size = max_len + max(buckets)`` (the tail holds the padding rows of a forward at the end).
The model calls ``update(key_states, value_states, layer_idx, ...)``, which writes at the forward's
``cache_position`` (we pass the slots; transformers 4.56 hands them over as ``cache_kwargs``, 5.x as
``kwargs``) and returns the whole buffer; the attention mask, always our own 4-D additive one
[1, 1, W, size] (which transformers passes through as it is), hides every slot at or above the
length. So rollback moves ``length`` (no crop, no copy), stale slots are overwritten by later
forwards, and a tree's compaction is one index copy inside each buffer. None of ``StaticCache``'s
internals, which differ between 4.56, 5.17 and 5.24, are used.

Buckets: a forward of n tokens is padded with copies of its last token to the smallest bucket
W >= n (:data:`TARGET_BUCKETS` 1, 2, 4, 8, 16, 32 by default; :data:`DRAFT_BUCKETS` 1, 2 for a
draft). Padding rows are written at slots [length + n, length + W) and see only themselves; no real
row sees them and ``length`` advances by n only. A forward wider than the largest bucket (a
prefill, mostly) runs unpadded and uncompiled, and says so once per model (a logging warning).

The step: :func:`static_step` is a pure function of the model, the cache and the tensors (ids,
positions, slots, mask) that returns logits [W, V] and the final hidden state [W, H] (the decoder's
output, after its final norm, then the output layer); no hook or Python state is touched inside
it, so ``torch.compile(fullgraph=True)`` takes it whole. The compiled steps are kept per model and
bucket for the whole process (a new runner of the same model reuses them); each gets a code object
of its own (:func:`_own_code`), as dynamo keeps its compiled variants per code object and would
otherwise count every bucket and every model as a recompile of one function (limit 8).

Compile settings (:data:`COMPILE_OPTIONS`, per device type; measured in docs/results/fast.md,
"The compiled forward against the weight-read floor"): on a CPU, inductor's ``freezing`` (the
weights become constants of the graph and each linear layer's weight is prepacked) with
``max_autotune`` over the ``CPP`` and ``ATEN`` GEMM backends, which picks inductor's C++ GEMM
template (AMX micro-kernels on this CPU) over oneDNN's linear. A decoding forward is a row of
matrix-vector products, which ATen's bf16 GEMM runs at 3-12 GB/s on one thread here: the template
brought the demo target's one-token forward from 2.2x the weight-read floor (plain compile) to
1.2x, the draft's from 3.4x to 1.05x. What that costs: each bucket's graph holds its own packed
copy of the weights (+~330 MB per bucket for the demo target); graphs holding packed oneDNN
weights skip inductor's FX graph cache ("mkldnn tensors unpickleable"), so every process pays the
whole compile, 80-100 s per target bucket on a quiet machine (plain: ~55 s, ~9 s from the cache);
and weights changed in place after a step compiled are not seen by it (the step holds the old
ones: use a new model object). Dynamo reads ``freezing`` from inductor's config while it traces,
so the first call runs under ``inductor.config.patch(freezing=...)`` (``torch.compile(options=)``
reaches inductor only); freezing needs autograd off, and every step runs under ``torch.no_grad``.
``COMPILE_OPTIONS["cpu"] = {}`` before a model's first compile gives the plain settings. Other
devices: no options (not measured there).

What compiling costs with the plain settings (torch 2.13 CPU, inductor, the 2-layer 32-wide
float32 Llama of tests/conftest.py, 1 thread on a shared 2-core machine; with the CPU settings
above, the test that compiles three buckets of it took 105 s): the first bucket of a process 20-25 s
(68 s under a load of 300; inductor's own start-up included), each further bucket 12-28 s; with inductor's FX graph cache warm
(on by default, ``TORCHINDUCTOR_CACHE_DIR``; a later process, same shapes) 11 s and 2 s. Each
compile is paid once per model, bucket and cache size in a process (``model_steps(model).
compile_seconds``, logged at INFO). A 135M-parameter target took 35-40 s per shape. What it buys
on that tiny model, cache of 100 tokens, medians: width 1 / 4 took 1.30 / 1.59 ms on the dynamic
cache, 1.22 / 1.40 ms static eager, 0.94 / 0.82 ms compiled (the mask, built on the host each feed,
0.08 ms). Recompiles: a new shape, dtype or an input aliasing another (positions and slots must be
distinct tensors) is a new graph (grad mode is not: the steps run without autograd);
tests/models/test_static_runner.py runs random feeds under ``error_on_recompile``.

Sizing per call (what the decoders use): :class:`CallRunners` builds a call's runners, sized to
the tokens the call can hold (prompt + max_new_tokens + its widest round + 1, the decoders say)
plus the padding tail, rounded up by :func:`call_max_len` to a power of two (at least
:data:`MIN_MAX_LEN`) and never below the largest size the decoder has used, so that calls of other
lengths share a cache size and with it the compiled steps; the buckets from :func:`fit_buckets`
(those up to the call's widest forward, so a prefill wider than that runs eager and no bucket is
compiled that the call cannot use). ``CallRunners.warm_up`` compiles them all before timing.
:func:`check_fast` is the one check of a ``fast`` argument.

Not done yet: the batch runner with batch buckets (``generate_batch`` refuses ``fast``); the
``graphs`` backend (a static address for the buffers, warm-up, capture, cloned outputs).
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from dataclasses import dataclass, field

import torch

from ..core.attention import decode_attention
from ..core.compat import cache_kwargs
from .runner import HiddenHook, ModelRunner

log = logging.getLogger(__name__)

TARGET_BUCKETS = (1, 2, 4, 8, 16, 32)
DRAFT_BUCKETS = (1, 2)
FAST_BACKENDS = (None, "static", "compile", "graphs")
# inductor's settings for fast="compile" by device type, none elsewhere (module docstring, "Compile settings")
COMPILE_OPTIONS: dict[str, dict] = {
    "cpu": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}}
DEFAULT_MAX_LEN = 2048  # capped at the model's max_position_embeddings
MIN_MAX_LEN = 256  # the smallest cache a decoder's call gets (call_max_len)


def check_fast(where: str, fast, device=None, *models) -> str | None:
    """``fast`` if it is a backend this build runs on ``device`` (None: not known yet), else a
    ValueError naming ``where``'s argument and the allowed values; ``models`` are checked to fit the
    static cache (:func:`check_static_model`) when ``fast`` is set."""
    if fast not in FAST_BACKENDS:
        raise ValueError(f"{where}: fast must be one of {', '.join(map(repr, FAST_BACKENDS))}, got {fast!r}")
    if fast == "graphs":
        device = None if device is None else torch.device(device)
        need = "needs CUDA" if device is not None and device.type != "cuda" else "is not built yet (issue 33)"
        raise ValueError(f"{where}: fast='graphs' {need}" + (f"; the models are on {device}" if device else "")
                         + ". Use fast='compile' or 'static'")
    if fast is not None:
        for model in models:
            check_static_model(model)
    return fast


def new_runner(model, vocab: int, want_hidden: bool, fast: str | None = None, *, max_len: int | None = None,
               buckets: tuple[int, ...] = TARGET_BUCKETS):
    """The runner the ``fast`` switch chooses (module docstring): ``None`` gives the eager
    :class:`ModelRunner`, ``"static"`` / ``"compile"`` a :class:`StaticRunner`."""
    if fast is None:
        return ModelRunner(model, vocab, want_hidden)
    return StaticRunner(model, vocab, want_hidden, fast=fast, max_len=max_len, buckets=buckets)


def call_max_len(tokens: int, model) -> int:
    """A static cache's size (``max_len`` plus the padding tail) for ``tokens`` tokens: the next
    power of two, at least :data:`MIN_MAX_LEN` and at most the model's ``max_position_embeddings``
    (never below ``tokens``), so that calls of nearby lengths share a size and its compiled steps."""
    limit = int(getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_LEN)
    return max(tokens, min(limit, max(MIN_MAX_LEN, 1 << (max(tokens, 1) - 1).bit_length())))


def fit_buckets(widest: int, buckets: tuple[int, ...] = TARGET_BUCKETS) -> tuple[int, ...]:
    """The ``buckets`` up to the first that holds ``widest`` tokens (all of them if none does)."""
    fit = next((i for i, b in enumerate(buckets) if b >= widest), len(buckets) - 1)
    return tuple(buckets[: fit + 1])


class CallRunners:
    """A decoder's runners across its calls, by one switch ``fast``: ``runners(tokens, buckets)``
    is a factory ``(model, vocab, want_hidden) -> runner`` for a call that holds at most ``tokens``
    tokens and feeds widths up to ``buckets[-1]`` in buckets (eager :class:`ModelRunner` for
    ``fast=None``). The static caches' size is the largest any call of this decoder has needed so
    far (:func:`call_max_len` of the tokens plus the padding tail, so the size does not depend on
    the buckets): a call that fits reuses it, and with it the compiled steps of every model and
    width. :meth:`warm_up` compiles every bucket at a call's size before anything is timed."""

    def __init__(self, fast: str | None, models) -> None:
        self.fast, self.models, self.size = fast, tuple(models), 0

    def _max_len(self, tokens: int, buckets: tuple[int, ...]) -> int:
        need = tokens + buckets[-1]
        if need > self.size:
            self.size = max(call_max_len(need, model) for model in self.models)
        return self.size - buckets[-1]

    def __call__(self, tokens: int, buckets: tuple[int, ...] = TARGET_BUCKETS):
        buckets = check_buckets(buckets)
        max_len = None if self.fast is None else self._max_len(tokens, buckets)

        def make(model, vocab: int, want_hidden: bool):
            return new_runner(model, vocab, want_hidden, self.fast, max_len=max_len, buckets=buckets)

        return make

    def warm_up(self, tokens: int, plan) -> float:
        """Compile each model's buckets ``plan`` [(model, buckets), ...] for a call of ``tokens``
        tokens (one forward of each width; the steps are kept for the process) unless compiled
        already; returns the seconds it took (0 unless ``fast="compile"``)."""
        if self.fast != "compile":
            return 0.0
        t0 = time.perf_counter()
        with torch.no_grad(), decode_attention(self.models[0].device):  # the state decoding compiles under
            for model, buckets in plan:
                runner = self(tokens, buckets)(model, 1, False)
                for width in runner.buckets:
                    runner.rollback(0)
                    runner.feed(torch.zeros(width, dtype=torch.long, device=runner.cache.keys[0].device))
        return time.perf_counter() - t0


@dataclass
class CachedLayer:
    """One layer's valid keys and values [1, kv_heads, length, head_dim] (views into the buffers)."""

    keys: torch.Tensor
    values: torch.Tensor


class StaticKV:
    """Preallocated keys and values per layer, written by the model at the slots it is given
    (module docstring); ``length`` of them are valid. The runner owns ``length``."""

    is_compileable = True  # read by some transformers mask code; never reached with our 4-D masks

    def __init__(self, config, size: int, dtype: torch.dtype, device) -> None:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (1, heads, size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.size, self.length = size, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None, *, kwargs: dict | None = None):
        """Write a forward's keys and values [1, kv_heads, W, head_dim] at its ``cache_position``
        slots [W]; return the layer's whole buffers (the mask hides what is not valid)."""
        slots = (cache_kwargs or kwargs or {}).get("cache_position")
        if slots is None:
            import transformers

            raise RuntimeError(f"transformers {transformers.__version__} did not hand the cache_position to the "
                               "cache's update(); StaticRunner needs a Llama-style model that does (4.56 and 5.24 do)")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if key_states.shape[1] != keys.shape[1] or key_states.shape[-1] != keys.shape[-1]:
            raise ValueError(f"layer {layer_idx} gave keys {tuple(key_states.shape)}; the static cache holds "
                             f"{tuple(keys.shape)} (kv heads and head_dim from the model's config)")
        keys.index_copy_(2, slots, key_states)
        values.index_copy_(2, slots, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def layers(self) -> list[CachedLayer]:
        """Each layer's valid entries, as ``DynamicCache.layers`` shows them (for comparisons)."""
        return [CachedLayer(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values, strict=True)]

    def compact(self, keep: list[int]) -> None:
        """Move the slots ``keep`` (checked by the runner) to the front, in order, with one index
        copy per buffer; slots before the first gap stay put. ``length`` becomes ``len(keep)``."""
        first = next((i for i, k in enumerate(keep) if k != i), len(keep))
        if first < len(keep):
            src = torch.tensor(keep[first:], device=self.keys[0].device)
            for buf in (*self.keys, *self.values):
                buf[:, :, first : len(keep)] = buf.index_select(2, src)
        self.length = len(keep)


def static_step(decoder, head, cache_arg: str, cache: StaticKV, ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over W tokens ``ids`` [W] at RoPE ``positions`` [W]: their keys and values go to
    the cache's ``slots`` [W], attention follows ``mask`` [1, 1, W, size] (additive). Returns the
    logits [W, V] and the final hidden state [W, H]. A pure function of its inputs (the cache
    buffers are written in place), so it compiles whole."""
    out = decoder(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, cache_position=slots,
                  use_cache=True, **{cache_arg: cache})
    hidden = out.last_hidden_state[0]
    return head(hidden), hidden


def _own_code(fn, name: str):
    """``fn`` with a code object of its own: dynamo keeps compiled variants per code object, so
    each bucket of each model compiles as a first compile rather than a recompile (module docstring)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass
class _ModelSteps:
    """What a model's fast path keeps for the whole process: its compiled steps by (bucket, cache
    size), the seconds each took to compile on first use, whether the wide-forward warning was given."""

    compiled: dict = field(default_factory=dict)
    compile_seconds: dict = field(default_factory=dict)
    warned_wide: bool = False


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_steps(model) -> _ModelSteps:
    """The process-wide fast-path state of ``model`` (compiled steps, compile times)."""
    steps = _STEPS.get(model)
    if steps is None:
        steps = _STEPS[model] = _ModelSteps()
    return steps


def check_static_model(model) -> None:
    """Refuse a model the static cache cannot serve: one without a separate decoder and output
    layer, with sliding-window or non-attention layers, an attention that takes no 4-D mask, or
    with soft-capped logits."""
    config = model.config
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(decoder, torch.nn.Module) or decoder is model or model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__}: the static runner needs a causal LM with get_decoder() and "
                         "get_output_embeddings() (Llama-style); use fast=None")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if getattr(config, "sliding_window", None) or layer_types != {"full_attention"}:
        raise ValueError(f"{type(model).__name__}: layer types {sorted(layer_types)} / sliding window "
                         f"{getattr(config, 'sliding_window', None)}; the static cache holds full-attention layers only; "
                         "use fast=None")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "eager", "sdpa"):
        raise ValueError(f"{type(model).__name__} uses attention {impl!r}, which does not take the static cache's 4-D "
                         "mask; load it with attn_implementation='sdpa' or 'eager', or use fast=None")
    if getattr(config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits, which the static step does not; use fast=None")


def check_buckets(buckets) -> tuple[int, ...]:
    out = tuple(int(b) for b in buckets)
    if not out or any(b < 1 for b in out) or list(out) != sorted(set(out)):
        raise ValueError(f"buckets must be strictly increasing positive widths, got {buckets!r}")
    return out


def check_keep(keep, length: int) -> list[int]:
    """``keep`` as a list of strictly increasing cache positions below ``length``, or a ValueError."""
    keep = [int(k) for k in keep]
    if any(b <= a for a, b in zip(keep, keep[1:], strict=False)) or (keep and (keep[0] < 0 or keep[-1] >= length)):
        raise ValueError(f"compact: keep must be strictly increasing cache positions < {length}, got {keep}")
    return keep


class StaticRunner(HiddenHook):
    """One model over a :class:`StaticKV` of ``max_len`` tokens, forwards padded to ``buckets``
    (module docstring). ``fast`` is ``"static"`` (eager) or ``"compile"``. Same interface as
    :class:`ModelRunner`; the hidden state comes from the step itself, so the context manager
    has no hook to install."""

    def __init__(self, model, vocab: int, want_hidden: bool, *, fast: str = "static", max_len: int | None = None,
                 buckets: tuple[int, ...] = TARGET_BUCKETS) -> None:
        device = next(model.parameters()).device
        if fast is None:
            raise ValueError("StaticRunner: fast must be 'static' or 'compile' (fast=None is the eager ModelRunner)")
        check_fast("StaticRunner", fast, device, model)
        self.model, self.vocab, self.want_hidden, self.fast = model, vocab, want_hidden, fast
        self.buckets = check_buckets(buckets)
        limit = int(getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_LEN)
        self.max_len = int(max_len) if max_len is not None else min(DEFAULT_MAX_LEN, limit)
        if self.max_len < 1:
            raise ValueError(f"max_len must be positive, got {max_len}")
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.cache_arg = next(iter(cache_kwargs(self.decoder, None)))
        dtype = next(model.parameters()).dtype
        self.cache = StaticKV(model.config, self.max_len + self.buckets[-1], dtype, device)
        self.steps = model_steps(model)
        self.compile_options = dict(COMPILE_OPTIONS.get(device.type, {}))
        self.mask_min = torch.finfo(dtype).min

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
        width = next((b for b in self.buckets if b >= n), n)
        if width == n > self.buckets[-1] and not self.steps.warned_wide:
            self.steps.warned_wide = True
            log.warning("%s: a forward of %d tokens is wider than the largest bucket (%d); such forwards run unpadded "
                        "and uncompiled (said once per model)", type(self.model).__name__, n, self.buckets[-1])
        pad = width - n
        slots = torch.arange(start, start + width, device=ids.device)
        if position_ids is None:  # a tensor of its own: an alias of slots would be another graph (a recompile)
            position_ids = torch.arange(start, start + width, device=ids.device)
        elif pad:
            position_ids = torch.cat([position_ids, position_ids[-1:].expand(pad)])
        if pad:
            ids = torch.cat([ids, ids[-1:].expand(pad)])
        mask = self._mask(n, width, attention_mask)
        with torch.no_grad():  # inference only: one graph whatever the caller's grad mode, and freezing needs it
            logits, hidden = self._step(width)(self.decoder, self.head, self.cache_arg, self.cache, ids, position_ids,
                                               slots, mask)
        self.cache.length = start + n
        rows = slice(n - n_logits, n)
        return logits[rows, : self.vocab], hidden[rows] if self.want_hidden else None

    def _mask(self, n: int, width: int, allowed: torch.Tensor | None) -> torch.Tensor:
        """The additive mask [1, 1, width, size]: real rows see the cache causally (or as
        ``allowed`` [n, length + n] says), padding rows see only themselves, nobody sees a slot at
        or above length + n otherwise."""
        start, device = self.length, self.cache.keys[0].device
        grid = torch.zeros(width, self.cache.size, dtype=torch.bool, device=device)
        if allowed is None:
            cols = torch.arange(start + n, device=device)
            grid[:n, : start + n] = cols[None] <= start + torch.arange(n, device=device)[:, None]
        elif allowed.shape != (n, start + n):
            raise ValueError(f"attention_mask must be [n, cached + n] = [{n}, {start + n}], got {tuple(allowed.shape)}")
        else:
            grid[:n, : start + n] = allowed
        pads = torch.arange(n, width, device=device)
        grid[pads, start + pads] = True
        mask = torch.zeros(grid.shape, dtype=self.cache.keys[0].dtype, device=device)
        return mask.masked_fill_(~grid, self.mask_min)[None, None]

    def _step(self, width: int):
        """The step for a forward of ``width`` tokens: eager, or this bucket's compiled step."""
        if self.fast != "compile" or width not in self.buckets:
            return static_step
        key = (width, self.cache.size)
        step = self.steps.compiled.get(key)
        if step is None:
            compiled = torch.compile(_own_code(static_step, f"static_step_w{width}_s{self.cache.size}"),
                                     fullgraph=True, dynamic=False, options=dict(self.compile_options) or None)
            step = self.steps.compiled[key] = self._timed_first_call(compiled, key)
        return step

    def _timed_first_call(self, compiled, key):
        """``compiled``, recording how long its first call (the compilation) took; that call runs
        with inductor's ``freezing`` as :attr:`compile_options` say, as dynamo reads it there while
        it traces (``torch.compile(options=)`` reaches inductor only)."""
        steps, freezing = self.steps, bool(self.compile_options.get("freezing", False))

        def first(*args):
            import torch._inductor.config as inductor_config

            t0 = time.perf_counter()
            with inductor_config.patch(freezing=freezing):
                out = compiled(*args)
            steps.compile_seconds[key] = time.perf_counter() - t0
            steps.compiled[key] = compiled
            log.info("compiled the static step of %s for width %d, cache size %d in %.1f s",
                     type(self.model).__name__, key[0], key[1], steps.compile_seconds[key])
            return out

        return first

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (no-op if fewer are cached): a position move."""
        if length < 0:
            raise ValueError(f"rollback length must be >= 0, got {length}")
        self.cache.length = min(self.length, int(length))

    def compact(self, keep) -> None:
        """As :meth:`ModelRunner.compact`: keep only the cached positions ``keep`` (strictly
        increasing), in that order, by an index copy inside each buffer."""
        self.cache.compact(check_keep(keep, self.length))
