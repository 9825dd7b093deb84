"""CUDA graphs per bucket (``fast="graphs"`` and ``"compile-graphs"``): a bucket's step captured on
its first use (:func:`capture_graph`, :class:`CapturedStep`) over KV buffers at static addresses,
which live in a :class:`GraphSet` kept for the process and leased by one live runner at a time
(:func:`lease_graph_set`); later forwards stage their inputs (:func:`stage_inputs`) and replay, and the
runners hand out copies of a replay's outputs (:func:`graph_outputs`). On a CPU the tests put a fake
in :func:`capture_graph`'s place (tests/helpers/graph_tape.py); docs/engine.md, "CUDA graphs per bucket"."""

from __future__ import annotations

import gc
import logging
import time
import weakref

import torch

from .kv import kv_buffers
from .step import ModelSteps, model_steps

log = logging.getLogger(__name__)

GRAPH_WARMUP = 3  # eager forwards on a side stream before a bucket's capture


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

    def run(self, steps: ModelSteps, key: tuple, name: str, step, *args) -> tuple:
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
                raise RuntimeError(f"fast='graphs': capturing {name} failed ({exc}); "
                                   "use fast='compile' or 'static'") from exc
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
