"""A runner over a static KV cache that the project owns, the foundation of the fast path (issue 33).

:class:`StaticRunner` has :class:`~specdecpp.models.runner.ModelRunner`'s interface (``length``,
``feed``, ``rollback``, ``compact``, the context manager, ``.cache`` with ``get_seq_length()`` and
``layers[i].keys``/``.values``) and is chosen by one switch, :func:`new_runner`'s ``fast``:

- ``None``: the eager :class:`ModelRunner` over transformers' ``DynamicCache``.
- ``"static"``: :class:`StaticRunner`, every forward run eagerly (no compilation).
- ``"compile"``: the same forwards through ``torch.compile(fullgraph=True, dynamic=False)``, one
  compiled step per bucket, compiled lazily on its first use (inductor on CPU).
- ``"graphs"`` (CUDA only; elsewhere a ValueError naming the device): the same steps run eagerly
  and captured as ``torch.cuda.CUDAGraph`` objects per bucket (below).
- ``"compile-graphs"`` (CUDA only): each bucket's compiled step (as ``"compile"``: inductor's fused
  kernels) captured as a CUDA graph, which is what ``torch.compile(mode="reduce-overhead")`` does
  with its own graph trees, over the project's buffers. A ``"graphs"`` replay of a small model is
  bound by the number of the eager step's kernels (scripts/count_step_ops.py counts them; what an
  H100 measured: docs/results/gpu.md); fusing them is what this backend is for.

What is owned: :class:`StaticKV`, a plain object (not a transformers ``Cache``) that Llama-style
models take as their cache. Per layer it preallocates keys and values [1, kv_heads, size, head_dim]
with ``size = max_len + max(buckets)`` (the tail holds the padding rows of a forward at the end).
The model calls ``update(key_states, value_states, layer_idx, ...)``, which writes at the forward's
slots and returns the whole buffer. The step hands the cache those slots itself (``cache.slots``, set
inside the step, before the forward) rather than relying on the model to pass ``cache_position``
through: transformers 4.56 hands it over as ``cache_kwargs`` and 5.24 as ``kwargs``, but 5.17 (the
GPU image's) calls ``update(key_states, value_states, layer_idx)`` with neither. The attention mask,
always our own 4-D additive one [1, 1, W, size] (which transformers passes through as it is), hides
every slot at or above the length. So rollback moves ``length`` (no crop, no copy), stale slots are
overwritten by later forwards, and a tree's compaction is one index copy inside each buffer. None of
``StaticCache``'s internals, which differ between 4.56, 5.17 and 5.24, are used.

Buckets: a forward of n tokens is padded with copies of its last token to the smallest bucket
W >= n (:data:`TARGET_BUCKETS` 1, 2, 4, 8, 16, 32 by default; :data:`DRAFT_BUCKETS` 1, 2 for a
draft). Padding rows are written at slots [length + n, length + W) and see the cache causally (a
tree's: only themselves); no real
row sees them and ``length`` advances by n only. A forward wider than the largest bucket (a
prefill, mostly) runs unpadded and uncompiled, and says so once per model (a logging warning).

The step: :func:`static_step` is a pure function of the model, the cache and the tensors (ids,
positions, slots, mask) that returns logits [W, V] and the final hidden state [W, H] (the decoder's
output, after its final norm, then the output layer); no hook or Python state is touched inside
it, so ``torch.compile(fullgraph=True)`` takes it whole. The compiled steps are kept per model and
bucket for the whole process (a new runner of the same model reuses them); each gets a code object
of its own (:func:`_own_code`), as dynamo keeps its compiled variants per code object and would
otherwise count every bucket and every model as a recompile of one function (limit 8).

Guards: dynamo evaluates a compiled function's guards on every call (the model's modules and
parameters, the cache's buffers, the arguments), 0.7-0.8 ms of a 135M-parameter Llama's forward on a
CPU. A step compiled by :func:`compiled_step` runs its later calls under
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: only the guards that tell its code
object's compiled variants apart (one variant) and the global state (autograd) are evaluated, and a
call that would need a recompile raises. Safe here because a step is compiled per model object and a
runner hands it only its bucket's shapes (and, under the CPU's ``freezing``, the weights are
constants of the graph anyway). Every guard is evaluated under ``error_on_recompile`` (the tests'
recompile checks) and on a torch older than 2.6, which lacks the stance (:data:`CAN_SKIP_GUARDS`).
Where it may skip them, a step goes further: its later calls bypass dynamo altogether and call the
graph inductor compiled on the first call, handed that call's own tensors (:func:`direct_call`;
checked once against dynamo's outputs, and only under the global state the graph compiled under).
Dynamo's own Python per call, some 130 calls, costs tenths of a millisecond on a CPU whose caches
each forward has flushed (docs/engine.md, "Later calls without dynamo").

Compile settings (:data:`COMPILE_OPTIONS`, per device type; measured in docs/results/fast.md,
"The compiled forward against the weight-read floor"): on a CPU, inductor's ``freezing`` (the
weights become constants of the graph and each linear layer's weight is prepacked) with
``max_autotune`` over the ``CPP`` and ``ATEN`` GEMM backends, which picks inductor's C++ GEMM
template (AMX micro-kernels on this CPU) over oneDNN's linear; buckets of at most
four rows (width x batch; the option ``narrow_gemm_rows``) get the template alone (:func:`narrow_options`: at four
rows autotuning, which times each GEMM with its weight in the cache, picked kernels 20% slower than
the template's on a Zen 4; from eight rows up the template alone is 2-4x slower), and a bucket whose
product the template cannot compute compiles again with ATen beside it (:func:`with_aten_gemms`).
A decoding forward is a row of
matrix-vector products, which ATen's bf16 GEMM runs at 3-12 GB/s on one thread here: the template
brought a 135M-parameter Llama's one-token forward from 2.2x the weight-read floor (plain compile) to
1.2x, a 15M-parameter one's from 3.4x to 1.05x. What that costs: each bucket's graph holds its own packed
copy of the weights (+~330 MB per bucket for a 135M-parameter Llama in bf16); 90-100 s per
bucket of such a target on a quiet machine (plain: ~55 s), 30-40% less since the first call compiles
under :func:`~specdecpp.models.codegen_memo.memoised_codegen` (inductor's templates and index expressions
kept by their text); a later process loads a bucket from inductor's FX graph cache (28 s for
that target's one-token bucket) since the first call also runs under
:func:`~specdecpp.models.packed_cache.packed_weights_cacheable`, which keys the oneDNN-packed weights
by their values (inductor alone skips graphs that hold them, "mkldnn tensors unpickleable"; float32's
MKL-packed weights still miss); and weights changed in place after a step compiled are not seen by it (the step holds the old
ones: use a new model object). Dynamo reads ``freezing`` from inductor's config while it traces,
so the first call runs under ``inductor.config.patch(freezing=...)`` (``torch.compile(options=)``
reaches inductor only); freezing needs autograd off, and every step runs under ``torch.no_grad``.
:func:`set_compile_options` (``"plain"``; infer's ``compile_options=plain``) before a bucket
compiles gives torch.compile's plain settings. Other devices: no options (not measured there).

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

Buckets not compiled yet: under ``"compile"`` and ``"compile-graphs"`` without a warm-up, a
forward whose bucket has not compiled yet runs in the smallest compiled bucket of its cache size
that holds it (more padding columns; for a batch, also padding rows within the buffer rows) until
the forwards it served there have taken as long, in all, as that bucket took to compile; then its
own compiles (ski rental: within about twice the better of compiling at once and never compiling;
the time is kept per bucket for the process, ``model_steps(model).rent``). So a batch that drains at
the end of a job (data_gen's sampling: 16 rows, then fewer) does not compile four smaller buckets
for its last few hundred forwards, nor a chain decoder a bucket for its few narrower forwards (a
tuned bucket of a 135M-parameter target takes a minute or two on a CPU). ``CallRunners.warm_up`` compiles
every bucket it names (``runner.cover = False``). Which bucket runs a forward then depends on time
spent, and buckets may round bf16 differently, so two such runs can draw different tokens at
near-ties (the tuned CPU settings' autotuning already picks kernels by timing races); warm up for
runs that must repeat bit for bit. On a GPU the host's clock sees only an asynchronous forward's
launch, so a bucket compiles later there than the rule says.

Batches (:class:`StaticBatchRunner`, what ``generate_batch`` and data_gen's sampling run on with
``fast``; ``CallRunners.batch`` builds it, ``CallRunners.warm_up(..., rows=)`` compiles its
buckets): the interface of the eager ``specdecpp.decoders.batch.BatchRunner`` over buffers [R,
kv_heads, size, head_dim] per layer, R buffer rows (the batch bucket that holds the call's rows;
more rows grow them, a copy). Row b of the batch lives in buffer row ``slot_of[b]`` and holds
``lengths[b]`` tokens at slots [0, lengths[b]); its positions are its own. A forward of W = the
longest chunk runs over the first B buffer rows, B the batch bucket (:data:`BATCH_BUCKETS` 1, 2,
4, 8, 16) that holds the highest occupied buffer row, W padded to a width bucket: row b's m_b real
tokens go to slots [lengths[b], lengths[b] + m_b), its padding columns above them, buffer rows no
row holds are all padding; the 4-D mask [B, 1, W, size] lets a real column see its row's slots up
to itself and a padding column only itself. The step (:func:`batch_step`, which :func:`static_step`
wraps) sees a :class:`RowWindow`: views of the first B buffer rows, written in place by an
``index_put`` at per-row slots, so a compiled step depends on (B, W, size) but not on R: runners
of any capacity share it. Rollback moves lengths (no copy); ``compact`` has nothing to do (no
holes); rows leaving free their buffer row (no copy) unless the rows left fit a smaller batch
bucket than the buffer rows they occupy, when the rows above it move down (a copy of those rows);
rows joining take the lowest free buffer rows, their prefixes prefilled in one eager forward over
just those rows, attending over the longest prefix's slots only (a gathered copy of those slots of
their buffers; over the whole buffer a 135M-parameter target's prefill of 16 rows took 8-10% longer on a
CPU, 1.3x the eager runner's time against 1.2x). More rows than the largest
batch bucket, or a wider forward than the largest width bucket, runs unpadded and uncompiled and
says so once per model. What it costs, beyond the one-row runner's: each decoding forward attends over all
``size`` slots of every row, also the padding rows, and the step computes logits for every column.

CUDA graphs (``fast="graphs"``): a graph replays kernels on fixed addresses, so the KV buffers of
a model and size live in a :class:`GraphSet` kept for the process (with each bucket's
:class:`CapturedStep` and one memory pool), leased by one live runner at a time
(:func:`lease_graph_set`; a second live runner gets a set of its own, a runner only a reference
cycle keeps does not count: the lease collects cycles first). Rollback moves lengths,
compaction and a batch's row moves are in-place index copies, and a growing batch runner leases
the larger set. A bucket is captured lazily on its first forward (or by ``CallRunners.warm_up``):
the forward's tensors are copied into the step's static inputs, the eager step runs
:data:`GRAPH_WARMUP` times on a side stream, then is captured (:func:`capture_graph`) and
replayed; later forwards stage their inputs (:func:`stage_inputs`) and replay. Under
``"compile-graphs"`` the step is the bucket's compiled one (:func:`compiled_step`), compiled by the
first warm-up run where an earlier forward has not compiled it; the capture time leaves that compile out (it is in
``compile_seconds``). The outputs of a
replay are overwritten by the next, so the runners return copies of the rows they hand out
(:func:`graph_outputs`). Capture time per bucket goes to ``model_steps(model).capture_seconds``
and a count of captures to ``.captures``. PEARL refuses it (two threads). On a CPU the tests put a
fake in :func:`capture_graph`'s place (tests/models/test_graphs.py); the real capture is tested
only under ``gpu`` and not yet measured.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import time
import types
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..core.attention import CPU_ATTENTION, attention_swap, decode_attention
from ..core.compat import cache_kwargs
from ..core.hooks import new_cache
from .codegen_memo import memoised_codegen
from .packed_cache import packed_weights_cacheable
from .runner import HiddenHook, ModelRunner

log = logging.getLogger(__name__)

TARGET_BUCKETS = (1, 2, 4, 8, 16, 32)
DRAFT_BUCKETS = (1, 2)
FAST_BACKENDS = (None, "static", "compile", "graphs", "compile-graphs")
GRAPH_BACKENDS = ("graphs", "compile-graphs")  # the backends that capture CUDA graphs (on static KV buffers)
BUCKETED_BACKENDS = ("compile", *GRAPH_BACKENDS)  # the backends whose buckets warm_up compiles or captures
COMPILING_BACKENDS = ("compile", "compile-graphs")  # the backends whose buckets inductor compiles (a minute or more on a CPU)
GRAPHS_DEVICE_TYPES = ("cuda",)  # where the graph backends run (tests add "cpu" beside a fake capture_graph)
GRAPH_WARMUP = 3  # eager forwards on a side stream before a bucket's capture
# torch.compiler.set_stance(skip_guard_eval_unsafe=) came with torch 2.6; before it, every guard is evaluated
CAN_SKIP_GUARDS = "skip_guard_eval_unsafe" in inspect.signature(getattr(torch.compiler, "set_stance", lambda: None)).parameters
# inductor's settings for fast="compile" by device type, none elsewhere (module docstring, "Compile settings");
# read when a bucket compiles (set_compile_options changes them)
TUNED_COMPILE_OPTIONS: dict[str, dict] = {
    "cpu": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", "narrow_gemm_rows": 4}}
COMPILE_OPTIONS: dict[str, dict] = {k: dict(v) for k, v in TUNED_COMPILE_OPTIONS.items()}
DEFAULT_MAX_LEN = 2048  # capped at the model's max_position_embeddings
MIN_MAX_LEN = 256  # the smallest cache a decoder's call gets (call_max_len)


def check_fast(where: str, fast, device=None, *models) -> str | None:
    """``fast`` if it is a backend this build runs on ``device`` (None: not known yet), else a
    ValueError naming ``where``'s argument and the allowed values; ``models`` are checked to fit the
    static cache (:func:`check_static_model`) when ``fast`` is set."""
    if fast not in FAST_BACKENDS:
        raise ValueError(f"{where}: fast must be one of {', '.join(map(repr, FAST_BACKENDS))}, got {fast!r}")
    if fast in GRAPH_BACKENDS and device is not None and torch.device(device).type not in GRAPHS_DEVICE_TYPES:
        raise ValueError(f"{where}: fast={fast!r} needs CUDA; the models are on {torch.device(device)}. "
                         "Use fast='compile' or 'static'")
    if fast is not None:
        for model in models:
            check_static_model(model)
    return fast


def new_runner(model, vocab: int, want_hidden: bool, fast: str | None = None, *, max_len: int | None = None,
               buckets: tuple[int, ...] = TARGET_BUCKETS, cover: bool = True):
    """The runner the ``fast`` switch chooses (module docstring): ``None`` gives the eager
    :class:`ModelRunner`, ``"static"`` / ``"compile"`` / ``"graphs"`` / ``"compile-graphs"`` a :class:`StaticRunner`."""
    if fast is None:
        return ModelRunner(model, vocab, want_hidden)
    return StaticRunner(model, vocab, want_hidden, fast=fast, max_len=max_len, buckets=buckets, cover=cover)


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
    width. :meth:`warm_up` compiles every bucket at a call's size before anything is timed.
    ``cover=False``: every forward runs in its own bucket, compiled on first use, never in a
    compiled larger one (the module docstring, "Buckets not compiled yet"): what a tool that times
    each bucket's own forward needs."""

    def __init__(self, fast: str | None, models, cover: bool = True) -> None:
        self.fast, self.models, self.size, self.cover = fast, tuple(models), 0, cover

    def _max_len(self, tokens: int, buckets: tuple[int, ...]) -> int:
        need = tokens + buckets[-1]
        if need > self.size:
            self.size = max(call_max_len(need, model) for model in self.models)
        return self.size - buckets[-1]

    def __call__(self, tokens: int, buckets: tuple[int, ...] = TARGET_BUCKETS):
        buckets = check_buckets(buckets)
        max_len = None if self.fast is None else self._max_len(tokens, buckets)

        def make(model, vocab: int, want_hidden: bool):
            return new_runner(model, vocab, want_hidden, self.fast, max_len=max_len, buckets=buckets, cover=self.cover)

        return make

    def batch(self, tokens: int, buckets: tuple[int, ...] = TARGET_BUCKETS, rows: int = 1, eager=None):
        """As calling it, for a batch: a factory ``(model, vocab, want_hidden) -> runner`` for a
        call whose rows hold at most ``tokens`` tokens each, at most ``rows`` of them at once:
        ``eager`` (the decoders' ``BatchRunner``, which this layer cannot import) for ``fast=None``,
        else a :class:`StaticBatchRunner` of the decoder's cache size."""
        buckets = check_buckets(buckets)
        if self.fast is None:
            if eager is None:
                raise ValueError("CallRunners.batch: fast=None needs the eager batch runner (eager=BatchRunner)")
            return eager
        return functools.partial(StaticBatchRunner, fast=self.fast, max_len=self._max_len(tokens, buckets),
                                 buckets=buckets, rows=rows, cover=self.cover)

    def warm_up(self, tokens: int, plan, rows: int | None = None, progress: bool = False) -> float:
        """Compile each model's buckets ``plan`` [(model, buckets), ...] for a call of ``tokens``
        tokens (one forward of each width; the steps are kept for the process) unless compiled
        already; with ``rows``, those of a batch call of at most ``rows`` rows at once instead
        (every batch bucket up to the one that holds ``rows``, times every width). Returns the
        seconds it took (0 unless ``fast`` compiles or captures: "compile", "graphs", "compile-graphs").
        ``progress``: a progress bar over the steps (a tuned target bucket compiles for minutes on a CPU)."""
        if self.fast not in BUCKETED_BACKENDS:
            return 0.0
        t0 = time.perf_counter()
        total = sum(len(buckets) * (1 if rows is None else len(fit_buckets(rows, BATCH_BUCKETS))) for _, buckets in plan)
        what = "capturing" if self.fast == "graphs" else "compiling"
        with torch.no_grad(), decode_attention(self.models[0].device), \
                tqdm(total=total, desc=f"fast={self.fast}: {what} steps", unit="step", disable=not progress) as bar:
            # (autograd off and the decoding attention: the state decoding compiles under)
            for model, buckets in plan:
                runner = None  # under graphs, the last model's runner releases its buffers before the next leases
                name = type(model).__name__
                if rows is None:
                    runner = self(tokens, buckets)(model, 1, False)
                    runner.cover = False  # every bucket its own step
                    for width in runner.buckets:
                        bar.set_postfix_str(f"{name} width {width}")
                        runner.rollback(0)
                        runner.feed(torch.zeros(width, dtype=torch.long, device=runner.device))
                        bar.update()
                    continue
                runner = self.batch(tokens, buckets, rows)(model, 1, False)
                runner.cover = False  # every bucket its own step
                for batch in fit_buckets(rows, runner.batch_buckets):
                    runner.select([])
                    runner.add_rows([torch.zeros(0, dtype=torch.long, device=runner.device)] * batch)
                    for width in runner.buckets:
                        bar.set_postfix_str(f"{name} batch {batch} width {width}")
                        runner.rollback([0] * batch)
                        runner.feed([torch.zeros(width, dtype=torch.long, device=runner.device)] * batch)
                        bar.update()
        return time.perf_counter() - t0


@dataclass
class CachedLayer:
    """One layer's valid keys and values [1, kv_heads, length, head_dim] (views into the buffers)."""

    keys: torch.Tensor
    values: torch.Tensor


def forward_slots(cache) -> torch.Tensor:
    """The slots the forward now running writes, as its step handed them to ``cache``."""
    slots = cache.slots
    if slots is None:
        raise RuntimeError(f"{type(cache).__name__}.update() called outside a static step (no slots handed over)")
    return slots


def check_layer_shape(layer_idx: int, key_states: torch.Tensor, keys: torch.Tensor) -> None:
    if key_states.shape[1] != keys.shape[1] or key_states.shape[-1] != keys.shape[-1]:
        raise ValueError(f"layer {layer_idx} gave keys {tuple(key_states.shape)}; the static cache holds "
                         f"{tuple(keys.shape)} (kv heads and head_dim from the model's config)")


def kv_buffers(config, rows: int, size: int, dtype: torch.dtype, device) -> tuple[list, list]:
    """Zeroed keys and values per layer, [rows, kv_heads, size, head_dim] each."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (rows, heads, size, head_dim)
    return ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)])


class StaticKV:
    """Preallocated keys and values per layer, written by the model at the slots it is given
    (module docstring); ``length`` of them are valid. The runner owns ``length``."""

    is_compileable = True  # read by some transformers mask code; never reached with our 4-D masks

    def __init__(self, config, size: int, dtype: torch.dtype, device, buffers: tuple | None = None) -> None:
        self.keys, self.values = buffers or kv_buffers(config, 1, size, dtype, device)  # buffers: a GraphSet's
        self.size, self.length = size, 0
        self.slots: torch.Tensor | None = None  # the running forward's slots [W], handed over by its step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None, *, kwargs: dict | None = None):
        """Write a forward's keys and values [1, kv_heads, W, head_dim] at its slots [W] (what its
        step handed over); return the layer's whole buffers (the mask hides what is not valid)."""
        slots = forward_slots(self)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        check_layer_shape(layer_idx, key_states, keys)
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


def batch_step(decoder, head, cache_arg: str, cache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over B rows of W tokens ``ids`` [B, W] at RoPE ``positions`` [B, W]: their keys
    and values go to the ``cache``'s ``slots``, attention follows ``mask`` [B, 1, W, size]
    (additive). Returns the logits [B, W, V] and the final hidden state [B, W, H]. A function of its
    inputs (the cache buffers are written in place), so it compiles whole. It hands ``slots`` to the
    cache (``cache.slots``) for the forward's ``update`` calls: transformers 5.17 passes no
    ``cache_position`` to ``update``. Under ``torch.compile`` that attribute is a side effect that
    dynamo replays after the graph; under CUDA graphs it is set at capture to the captured step's own
    slots tensor, which every replay refills."""
    cache.slots = slots
    out = decoder(input_ids=ids, position_ids=positions, attention_mask=mask, cache_position=slots,
                  use_cache=True, **{cache_arg: cache})
    hidden = out.last_hidden_state
    return head(hidden), hidden


def static_step(decoder, head, cache_arg: str, cache: StaticKV, ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`batch_step` of one row: ``ids`` and ``positions`` [W], ``slots`` [W] in the cache,
    ``mask`` [1, 1, W, size]; returns the logits [W, V] and the final hidden state [W, H]."""
    logits, hidden = batch_step(decoder, head, cache_arg, cache, ids[None], positions[None], slots, mask)
    return logits[0], hidden[0]


def _own_code(fn, name: str):
    """``fn`` with a code object of its own: dynamo keeps compiled variants per code object, so
    each bucket of each model compiles as a first compile rather than a recompile (module docstring)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass
class _ModelSteps:
    """What a model's fast path keeps for the whole process: its compiled steps by (bucket, cache
    size) or (bucket, cache size, batch bucket) (:func:`compiled_step`), the seconds each took to
    compile on first use, whether the wide-forward and the many-rows warnings were given."""

    compiled: dict = field(default_factory=dict)
    compile_seconds: dict = field(default_factory=dict)
    warned_wide: bool = False
    warned_rows: bool = False
    causal: dict = field(default_factory=dict)  # (size, dtype, device) -> additive causal mask [size, size] (StaticRunner)
    chain_inputs: dict = field(default_factory=dict)  # (size, dtype, device, start, width) -> (slots, positions, mask)
    graph_sets: dict = field(default_factory=dict)  # fast="graphs": (rows, size, dtype) -> [GraphSet, ...]
    capture_seconds: dict = field(default_factory=dict)  # fast="graphs": step key -> warm-up + capture seconds, less a compile
    captures: int = 0  # fast="graphs": buckets captured in this process (a recapture shows here)
    rent: dict = field(default_factory=dict)  # a bucket not compiled -> seconds its forwards took in a larger one


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_steps(model) -> _ModelSteps:
    """The process-wide fast-path state of ``model`` (compiled steps, compile times)."""
    steps = _STEPS.get(model)
    if steps is None:
        steps = _STEPS[model] = _ModelSteps()
    return steps


def compiled_step(model, step, key: tuple, name: str, steps: _ModelSteps | None = None, options: dict | None = None):
    """``step`` (:func:`static_step` or :func:`batch_step`) compiled for ``model``'s bucket ``key``
    (the widths, then the cache size: (width, size) for a row, (width, size, batch) for a batch),
    once per process: ``torch.compile(fullgraph=True, dynamic=False)`` of a copy with a code object
    of its own named ``name`` (:func:`_own_code`) with the :data:`COMPILE_OPTIONS` of the model's
    device type (or ``options``), compiled on its first call, which is timed into
    ``model_steps(model).compile_seconds[key]`` (or ``steps``: what a runner keeps, :attr:`StaticModel.steps`)."""
    steps = model_steps(model) if steps is None else steps
    compiled_fn = steps.compiled.get(key)
    if compiled_fn is not None:
        return compiled_fn
    if options is None:
        options = COMPILE_OPTIONS.get(next(model.parameters()).device.type, {})
    options = narrow_options(options, key[0] * (key[2] if len(key) > 2 else 1))
    graphs: list = []  # what inductor compiled for this step: (callable, example inputs), the latest last
    compiled = _compile(step, name, options, graphs)
    fallback = with_aten_gemms(options)
    direct = None  # the compiled graph called without dynamo (module docstring, "Guards"), once checked

    def unguarded(*args):  # the module docstring, "Guards"
        if not CAN_SKIP_GUARDS or torch._dynamo.config.error_on_recompile:  # every guard evaluated
            return compiled(*args)
        if direct is not None and direct.state.check():  # the global state it compiled under (autograd, ...)
            return direct(*args)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return compiled(*args)

    def first(*args):
        import torch._inductor.config as inductor_config

        if steps.compiled.get(key) is unguarded:  # compiled by an earlier call (a graph's warm-up holds this wrapper)
            return unguarded(*args)
        nonlocal compiled
        t0 = time.perf_counter()
        # dynamo reads ``freezing`` from inductor's config while it traces (options= reaches inductor only)
        with inductor_config.patch(freezing=bool(options.get("freezing", False))), quiet_autotuning(options), \
                memoised_codegen(), packed_weights_cacheable():
            try:
                out = compiled(*args)
            except Exception as e:  # inductor wraps its errors (InductorError, BackendCompilerFailed)
                if fallback is None or NO_GEMM_CHOICE not in str(e):
                    raise
                log.warning("%s of %s: inductor's C++ GEMM template cannot compute one of its matrix products; "
                            "compiling it again with ATen's GEMMs beside the template", name, type(model).__name__)
                compiled = _compile(step, name, fallback, graphs)
                out = compiled(*args)
        steps.compile_seconds[key] = time.perf_counter() - t0
        nonlocal direct
        direct = direct_call(graphs, args, out, name)
        steps.compiled[key] = unguarded
        log.info("compiled %s of %s in %.1f s", name, type(model).__name__, steps.compile_seconds[key])
        return out

    steps.compiled[key] = first
    return first


def _compile(step, name: str, options: dict, graphs: list):
    """``torch.compile(fullgraph=True, dynamic=False)`` of a copy of ``step`` named ``name`` with
    inductor and ``options``, each graph inductor returns also appended to ``graphs`` with its
    example inputs (:class:`_KeptGraphs`; torch.compile's own inductor backend where this torch
    has no such class to extend)."""
    code = _own_code(step, name)
    base = getattr(torch, "_TorchCompileInductorWrapper", None)
    if base is None:
        return torch.compile(code, fullgraph=True, dynamic=False, options=options or None)
    return torch.compile(code, fullgraph=True, dynamic=False, backend=_kept_graphs(base)(options, graphs))


@functools.cache
def _kept_graphs(base: type) -> type:
    class _KeptGraphs(base):
        """torch.compile's inductor backend (``options`` as torch.compile's ``options=``) that also
        keeps what it compiled: ``(callable, example inputs)`` appended to ``graphs``."""

        def __init__(self, options: dict, graphs: list) -> None:
            super().__init__(None, options or None, False)
            self.options, self.graphs = options or None, graphs

        def __call__(self, model_, inputs_):
            fn = super().__call__(model_, inputs_)
            self.graphs.append((fn, list(inputs_)))
            return fn

    return _KeptGraphs


def step_tensors(args: tuple) -> list:
    """The tensors a step's call ``(decoder, head, cache_arg, cache, ids, positions, slots, mask)``
    hands its graph that change from call to call or runner to runner: its four tensor arguments,
    then the cache's per-layer key and value buffers."""
    cache = args[3]
    return [*args[4:8], *cache.keys, *cache.values]


def direct_call(graphs: list, args: tuple, out, name: str):
    """A step's compiled graph called as dynamo's compiled code calls it, without dynamo: each later
    call skips dynamo's frame evaluation and its guards (which a step skips anyway), 0.1-0.6 ms of
    host time a call on a CPU (module docstring, "Guards"). ``graphs[-1]`` is what inductor compiled
    on the first call ``args``, which returned ``out``: its example inputs are matched by identity
    to the call's :func:`step_tensors` (the rest, the weights and buffers of the model, are held as
    they are), and the graph is called once more with ``args``, which writes the same keys and
    values to the same slots again and must return ``out`` bit for bit. Returns ``(*args) ->
    (logits, hidden)``, replaying the one side effect dynamo replays that matters (``cache.slots``,
    :func:`batch_step`), with ``state``: dynamo's check of the global state (autograd, autocast, ...)
    as it is now, the state the graph compiled under; or None where the match or the check fails
    (said at DEBUG level), or this torch has no such check: dynamo then calls the graph as before."""
    state = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    if state is None or not hasattr(state, "GlobalStateGuard"):
        return None
    if len(graphs) != 1 or not isinstance(out, tuple):  # a recompile, or another output structure
        log.debug("%s: %d graphs compiled; calls go through dynamo", name, len(graphs))
        return None
    fn, example = graphs[-1]
    tensors = step_tensors(args)
    position = {id(t): i for i, t in enumerate(tensors)}
    spec = [(position.get(id(t), -1), None if id(t) in position else t) for t in example]
    placed = [i for i, _ in spec if i >= 0]
    if len(position) != len(tensors) or len(set(placed)) != len(placed):  # a tensor in two places
        log.debug("%s: its graph's inputs are not the step's tensors one to one; calls go through dynamo", name)
        return None

    def call(*args):
        tensors = step_tensors(args)
        args[3].slots = args[6]
        return tuple(fn(*[tensors[i] if i >= 0 else t for i, t in spec]))

    try:
        again = call(*args)
    except Exception as exc:  # noqa: BLE001 - any failure: dynamo's path stays
        log.debug("%s: calling its graph directly failed (%s); calls go through dynamo", name, str(exc))
        return None
    if len(again) != len(out) or not all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                                         and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(again, out, strict=True)):
        log.debug("%s: its graph called directly returned other outputs; calls go through dynamo", name)
        return None
    call.state = state.GlobalStateGuard()  # a call under another global state goes through dynamo, which refuses it
    return call


NARROW_KEY = "narrow_gemm_rows"  # the project's own option (not inductor's): see narrow_options
NO_GEMM_CHOICE = "No choices to select"  # inductor's NoValidChoicesError: no backend it was given serves a GEMM


def narrow_options(options: dict, rows: int) -> dict:
    """The inductor options a bucket of ``rows`` rows (width x batch) compiles with: ``options``
    without the project's own key ``narrow_gemm_rows``, and where that key is set and ``rows`` is at
    most it, with the C++ GEMM template alone (``max_autotune_gemm_backends="CPP"``). The CPU's tuned
    settings set it to 4: inductor's autotuning times each GEMM with its weight in the cache, where a
    forward streams it from memory, and at four rows it picked kernels 20% slower than the
    template's; from eight rows up the template alone is 2-4x slower (module docstring, "Compile
    settings"). A ``compile_options`` mapping without the key autotunes every bucket."""
    options = dict(options)
    limit = options.pop(NARROW_KEY, None)
    if limit is not None and rows <= int(limit):
        options["max_autotune_gemm_backends"] = "CPP"
    return options


def with_aten_gemms(options: dict) -> dict | None:
    """``options`` with ATen added to ``max_autotune_gemm_backends``, or None where they allow it
    already (inductor's default backends include it) or do not autotune: what a bucket compiles with
    again where the template alone leaves a matrix product without a kernel (a float64 model, a
    transposed input), which inductor refuses with "No choices to select"."""
    backends = [b.strip().upper() for b in str(options.get("max_autotune_gemm_backends", "ATEN")).split(",")]
    if not options.get("max_autotune") or "ATEN" in backends:
        return None
    return {**options, "max_autotune_gemm_backends": ",".join([*backends, "ATEN"])}


@contextlib.contextmanager
def quiet_autotuning(options: dict):
    """Under ``max_autotune``, inductor writes every GEMM's candidate timings to stderr (dozens of
    lines per bucket) and warns that TypedStorage is deprecated; keep them to this logger's DEBUG level (``PRINT_AUTOTUNE`` is a module flag
    of inductor's, ``max_autotune_report_choices_stats`` a config, where this torch has them)."""
    if not options.get("max_autotune") or log.isEnabledFor(logging.DEBUG):
        yield
        return
    import torch._inductor.config as inductor_config
    import torch._inductor.select_algorithm as select_algorithm

    quiet = {k: False for k in ("max_autotune_report_choices_stats",) if hasattr(inductor_config, k)}
    printing = getattr(select_algorithm, "PRINT_AUTOTUNE", None)
    with inductor_config.patch(**quiet), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)  # inductor's autotuner, per GEMM
        if printing is not None:
            select_algorithm.PRINT_AUTOTUNE = False
        try:
            yield
        finally:
            if printing is not None:
                select_algorithm.PRINT_AUTOTUNE = printing


def set_compile_options(options: str | dict | None, device_type: str = "cpu") -> dict:
    """Choose inductor's options for ``fast="compile"`` on ``device_type`` from now on (buckets
    compiled earlier keep theirs): ``"tuned"`` or None the default (:data:`TUNED_COMPILE_OPTIONS`,
    freezing + max_autotune on a CPU), ``"plain"`` none (``torch.compile``'s defaults: a quarter of
    the compile time, kept in inductor's FX graph cache, a slower forward), or a dict of inductor
    options. Returns the options now in force."""
    if options is None or options == "tuned":
        chosen = dict(TUNED_COMPILE_OPTIONS.get(device_type, {}))
    elif options == "plain":
        chosen = {}
    elif hasattr(options, "items"):  # a dict, or a mapping from a config
        chosen = dict(options.items())
    else:
        raise ValueError(f"compile_options must be 'tuned', 'plain' or a dict of inductor options, got {options!r}")
    COMPILE_OPTIONS[device_type] = chosen
    return chosen


def capture_graph(run, pool, warmup: int = GRAPH_WARMUP):
    """``run()`` (a forward over static input tensors; it returns a tuple of tensors) captured as a
    ``torch.cuda.CUDAGraph`` in memory ``pool``, after ``warmup`` eager runs on a side stream (they
    pick the kernels and fill the allocator before capture). Returns ``(replay, outputs)``:
    ``replay()`` reruns the forward on whatever the static inputs hold and rewrites ``outputs``
    (tensors of the pool: the next replay of any graph of the pool may overwrite them)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    return graph.replay, outputs


def stage_inputs(static: tuple, given: tuple) -> None:
    """Copy a forward's ``given`` tensors into a captured step's ``static`` ones (the addresses its
    graph reads), which must match them in shape and dtype (a bucket's key fixes both)."""
    if len(static) != len(given):
        raise ValueError(f"a captured step takes {len(static)} inputs, got {len(given)}")
    for i, (dst, src) in enumerate(zip(static, given, strict=True)):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"input {i} of a captured step is {tuple(src.shape)} {src.dtype}; the graph was captured "
                             f"for {tuple(dst.shape)} {dst.dtype}")
        dst.copy_(src, non_blocking=True)


def graph_outputs(replayed: bool, logits: torch.Tensor, hidden: torch.Tensor | None):
    """What a runner hands out of a forward: ``logits`` and ``hidden`` (or None) as they are, or,
    when they are views of a replayed graph's outputs (``replayed``), copies (the next replay would
    overwrite them)."""
    if not replayed:
        return logits, hidden
    return logits.clone(), None if hidden is None else hidden.clone()


class CapturedStep:
    """One bucket's step as a CUDA graph: built from a first forward's inputs (copied into static
    tensors of its own), the step's ``fixed`` leading arguments (decoder, output layer, cache
    argument, the cache over a :class:`GraphSet`'s buffers) run :data:`GRAPH_WARMUP` times eagerly,
    then captured (:func:`capture_graph`). Calling it stages the inputs and replays; it returns the
    graph's own outputs, which the next replay overwrites (the runners clone what they hand out).
    Nothing of the Python forward is kept (no reference to the model)."""

    def __init__(self, step, fixed: tuple, inputs: tuple, pool) -> None:
        self.inputs = tuple(t.clone() for t in inputs)
        static = self.inputs

        def run():
            return step(*fixed, *static)

        with torch.no_grad():
            self.replay, self.outputs = capture_graph(run, pool)

    def __call__(self, *inputs) -> tuple:
        stage_inputs(self.inputs, inputs)
        self.replay()
        return self.outputs


class GraphSet:
    """What ``fast="graphs"`` keeps of a model for the whole process, per (buffer rows, cache
    size, dtype): KV buffers at a static address (a CUDA graph reads and writes them by address:
    rollback, compaction and row moves stay in place), the :class:`CapturedStep` of each bucket
    over them, and one memory pool their graphs share (they never run at once; outputs are cloned
    before the next replay). A runner leases a set (:func:`lease_graph_set`) for its lifetime; a
    second live runner of the same model and size gets a set of its own (buffers and captures)."""

    def __init__(self, config, rows: int, size: int, dtype: torch.dtype, device) -> None:
        self.keys, self.values = kv_buffers(config, rows, size, dtype, device)
        self.rows, self.size = rows, size
        self.graphs: dict = {}
        self.rounds: dict = {}  # a target's set: the captured rounds over it (specdecpp/decoders/captured.py)
        self.pool = None  # torch.cuda.graph_pool_handle(), taken at the first capture
        self.owner = None  # weakref to the runner that holds the set

    def free(self) -> bool:
        return self.owner is None or self.owner() is None

    def run(self, steps: _ModelSteps, key: tuple, name: str, step, *args) -> tuple:
        """``step(*args)`` through bucket ``key``'s graph, captured on its first use (timed into
        ``steps.capture_seconds[key]``, less any compile its warm-ups ran, which ``compile_seconds`` holds;
        counted in ``steps.captures``): the first 4 arguments
        (decoder, output layer, cache argument, cache) are fixed by the capture, the others are
        tensors staged into it. (Holds no runner: a runner's steps refer to it without a cycle.)"""
        fixed, inputs = args[:4], args[4:]
        graph = self.graphs.get(key)
        if graph is None:
            t0, compiling = time.perf_counter(), sum(steps.compile_seconds.values())
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
            try:
                graph = CapturedStep(step, fixed, inputs, self.pool)
            except RuntimeError as exc:
                raise RuntimeError(f"fast='graphs': capturing {name} failed ({exc}); use fast='compile' or 'static'") from exc
            self.graphs[key] = graph
            steps.captures += 1
            compiled = sum(steps.compile_seconds.values()) - compiling  # compile-graphs: a first warm-up's compile
            steps.capture_seconds[key] = time.perf_counter() - t0 - compiled
            log.info("captured %s in %.2f s", name, steps.capture_seconds[key])
        return graph(*inputs)


def lease_graph_set(model, owner, rows: int, size: int, dtype: torch.dtype, device) -> GraphSet:
    """A free :class:`GraphSet` of ``model`` for ``rows`` buffer rows of ``size`` slots (a new one
    if every such set is held by a live runner), now held by ``owner`` until it is garbage (or the
    set's ``owner`` is set to None). Where every set is held, the cyclic garbage collector
    runs first: a runner that nothing reachable refers to but a reference cycle still keeps (the
    frames of a caught exception's traceback, say, which hold the runner whose forward raised) is
    not live, and a second set would cost its buffers and every capture again."""
    sets = model_steps(model).graph_sets.setdefault((rows, size, dtype), [])
    graph_set = next((s for s in sets if s.free()), None)
    if graph_set is None and sets:
        gc.collect()
        graph_set = next((s for s in sets if s.free()), None)
    if graph_set is None:
        graph_set = GraphSet(model.config, rows, size, dtype, device)
        sets.append(graph_set)
    graph_set.owner = weakref.ref(owner)
    return graph_set


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
    if impl not in (None, "eager", "sdpa", CPU_ATTENTION):  # CPU_ATTENTION: inside another runner's forward
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


class StaticModel(HiddenHook):
    """What both static runners share: the model as its decoder and output layer, the name the
    decoder takes its cache under, ``max_len``, the width ``buckets``, the model's process-wide
    steps (:func:`model_steps`) and the mask's fill value. The hidden state comes from the step
    itself, so the context manager has no hook to install."""

    def __init__(self, model, vocab: int, want_hidden: bool, fast: str, max_len: int | None,
                 buckets: tuple[int, ...], cover: bool = True) -> None:
        self.device = next(model.parameters()).device
        if fast is None:
            raise ValueError(f"{type(self).__name__}: fast must be 'static', 'compile' or 'graphs' (fast=None is the eager "
                             "runner)")
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
        # a bucket that has not compiled yet runs in a compiled larger one until it pays (_cover); warm_up turns it off
        self.cover = cover and fast in COMPILING_BACKENDS
        # around each forward: the CPU's attention in place of sdpa (core.attention.attention_swap), the way
        # decided once here, the cheapest this config allows (a partial: forward_at's closures hold no runner)
        self.attention = attention_swap(model.config, self.device)

    def _cover(self, size: int, width: int, batch: int | None = None) -> tuple[int, int | None, tuple | None]:
        """The bucket a forward that needs bucket ``width`` (and ``batch``: a batch runner's) of
        cache ``size`` runs in, and the key it rents for: its own if compiled, else the smallest
        compiled bucket that holds it (a batch bucket within the buffer rows) while the forwards it
        served there took less time in all than that bucket took to compile (ski rental; the module
        docstring, "Buckets not compiled yet"), else its own, compiled on this forward."""
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
    """One model over a :class:`StaticKV` of ``max_len`` tokens, forwards padded to ``buckets``
    (module docstring). ``fast`` is ``"static"`` (eager), ``"compile"`` or ``"graphs"``. Same interface as
    :class:`ModelRunner`."""

    def __init__(self, model, vocab: int, want_hidden: bool, *, fast: str = "static", max_len: int | None = None,
                 buckets: tuple[int, ...] = TARGET_BUCKETS, cover: bool = True) -> None:
        super().__init__(model, vocab, want_hidden, fast, max_len, buckets, cover)
        size = self.max_len + self.buckets[-1]
        buffers, self._graph_steps = None, {}
        if fast in GRAPH_BACKENDS:  # the buffers the captured graphs of this model and size read (static addresses)
            self.graph_set = lease_graph_set(model, self, 1, size, self.dtype, self.device)
            buffers = (self.graph_set.keys, self.graph_set.values)
        self.cache = StaticKV(model.config, size, self.dtype, self.device, buffers)

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
        pad = width - n
        if position_ids is None and attention_mask is None:  # a chain's forward: inputs kept for the process
            slots, position_ids, mask = self.chain_inputs(start, width)
        else:
            slots = torch.arange(start, start + width, device=ids.device)
            if position_ids is None:  # a tensor of its own: an alias of slots would be another graph (a recompile)
                position_ids = torch.arange(start, start + width, device=ids.device)
            elif pad:
                position_ids = torch.cat([position_ids, position_ids[-1:].expand(pad)])
            mask = self._mask(n, width, attention_mask)
        if pad:
            ids = torch.cat([ids, ids[-1:].expand(pad)])
        # inference only: one graph whatever the caller's grad mode, and freezing needs it; a decoder's generate
        # runs without autograd already, and then no torch context is entered (one operation fewer a feed)
        t0 = time.perf_counter() if renting else 0.0
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext(), self.attention():
            logits, hidden = self._step(width)(self.decoder, self.head, self.cache_arg, self.cache, ids, position_ids,
                                               slots, mask)
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
            return static_step
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
            return static_step
        key, name = (width, self.cache.size), f"static_step_w{width}_s{self.cache.size}"
        return compiled_step(self.model, static_step, key, name, self.steps, self.compile_options)

    def forward_at(self, width: int):
        """A chain forward of one bucket's width, as a captured round runs it
        (specdecpp/decoders/captured.py): a callable ``(ids [width], start) -> (logits [width, V], hidden
        [width, H])`` writing slots ``start`` .. ``start + width - 1``, ``start`` a 0-d long tensor on the
        device, so nothing is read on the host; ``length`` is left to the caller. It holds this
        runner's buffers (under the graph backends, its leased set's) and no reference to the runner."""
        if width not in self.buckets:
            raise ValueError(f"forward_at: width {width} is not one of the buckets {self.buckets}")
        cache = StaticKV(self.model.config, self.cache.size, self.dtype, self.device, (self.cache.keys, self.cache.values))
        fixed, step, causal = (self.decoder, self.head, self.cache_arg, cache), self.plain_step(width), self.causal_mask()

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


class RowWindow:
    """The cache one batched forward of :class:`StaticBatchRunner` sees (module docstring): per
    layer ``keys``/``values``, either views of the first B rows of the runner's buffers [B,
    kv_heads, size, head_dim] (``rows`` None: the forward's row i is buffer row i, written and read
    in place) or the whole buffers with ``rows`` [B] naming the buffer row of each forward row
    (written in place, read as a gathered copy of their first ``span`` slots: the eager prefill of
    joining rows, whose tokens all lie below ``span``)."""

    is_compileable = True  # read by some transformers mask code; never reached with our 4-D masks

    def __init__(self, keys: list, values: list, rows: torch.Tensor | None = None, span: int | None = None) -> None:
        self.keys, self.values, self.rows, self.span = keys, values, rows, span
        self.slots: torch.Tensor | None = None  # the running forward's slots [B, W], handed over by its step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None, *, kwargs: dict | None = None):
        """Write a forward's keys and values [B, kv_heads, W, head_dim] at its slots [B, W] (each
        row its own); return the buffers its attention reads [B, kv_heads, size (or span), head_dim]."""
        slots = forward_slots(self)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        check_layer_shape(layer_idx, key_states, keys)
        rows = torch.arange(key_states.shape[0], device=slots.device) if self.rows is None else self.rows
        keys[rows[:, None], :, slots] = key_states.transpose(1, 2)
        values[rows[:, None], :, slots] = value_states.transpose(1, 2)
        if self.rows is None:
            return keys, values
        return keys[:, :, : self.span].index_select(0, self.rows), values[:, :, : self.span].index_select(0, self.rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and slots are always passed; never read


BATCH_BUCKETS = (1, 2, 4, 8, 16)


class StaticBatchRunner(StaticModel):
    """One model over a static cache of per-row lengths, with the interface of the eager
    ``specdecpp.decoders.batch.BatchRunner`` (``feed(chunks, n_logits)``, ``rollback(lengths)``,
    ``compact()``, ``select(keep)``, ``add_rows(prefixes)``, ``row_cache(b)``, ``rows``,
    ``lengths``, ``width``; the module docstring says how it works). ``rows``: the most rows
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
        logits, hidden = self._forward(ids, lengths, real, None, compiled)
        if renting:
            self._pay_rent(renting, t0)
        self.lengths = [n + k for n, k in zip(self.lengths, m, strict=True)]
        keep = width if n_logits is None else min(n_logits, width)
        if self.slot_of != list(range(self.rows)):
            order = torch.tensor(self.slot_of, device=self.device)
            logits, hidden = logits.index_select(0, order), hidden.index_select(0, order)
        logits, hidden = logits[: self.rows, width - keep : width, : self.vocab], hidden[: self.rows, width - keep : width]
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
        step, key, name = batch_step, (width, self.size, batch), f"batch_step_b{batch}_w{width}_s{self.size}"
        if compiled and self.fast != "graphs":  # compile, compile-graphs: the bucket's compiled step
            step = compiled_step(self.model, batch_step, key, name, self.steps, self.compile_options)
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
            self._forward(ids, [0] * len(fed), [m[i] for i in fed], rows, compiled=False, span=width)
        self.slot_of += slots
        self.lengths += m

    def row_cache(self, b: int):
        """Row b's cached tokens alone, as a fresh transformers cache [1, heads, lengths[b], d]."""
        cache, slot, length = new_cache(self.model), self.slot_of[b], self.lengths[b]
        for i, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            cache.layers[i].update(keys[slot : slot + 1, :, :length].clone(), values[slot : slot + 1, :, :length].clone())
        return cache
