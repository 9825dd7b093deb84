"""A CPU stand-in for a CUDA graph that keeps a CUDA graph's rules (tests/models/test_graphs.py's
``graphs_on("cpu")``).

A CUDA graph records the kernels that one run of a function launches and replays only those: the
Python code runs once, at capture, so anything it decided on the host (a branch, a Python counter, a
value read with ``.item()``) is frozen into the graph; every tensor the graph touches keeps its
address; and a capture refuses what needs the host in the middle (a synchronising read, an output
whose shape depends on values, a draw from a generator the graph does not own). A fake that reran
the captured function on each replay would let code pass on a CPU that a CUDA replay would run wrong.

:func:`tape_capture` records the ATen operations of the captured run (a ``TorchDispatchMode``) and a
replay re-executes that tape on the same tensor objects, writing each operation's result into the
tensor it produced at capture (views of those tensors stay views: they are not re-executed).
During capture it raises, as CUDA would, on a host read (``_local_scalar_dense``: ``.item()``,
``int(t)``, ``bool(t)``), on operations whose output shape depends on values (``nonzero``,
``masked_select``, ``unique``) and on random draws (operations tagged ``nondeterministic_seeded``).
The captured run's outputs are then filled with garbage, since a CUDA capture does not execute
what it records: only a replay writes them. (Not modelled: a capture's memory pool reusing a freed
tensor of another graph, and host reads that bypass dispatch, ``.tolist()`` and ``.numpy()``.)

Compiled code is not taped (torch.compile refuses to run under a dispatch mode, and inductor's
kernels bypass the dispatcher): where the warm-ups called a compiled step, :func:`fake_capture`
fakes the graph by rerunning it (:func:`rerun_capture`). :func:`install` puts the fake in place."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specdecpp.fast import buckets, compiling, graphs

SHAPE_FROM_VALUES = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                     "nonzero_static", "argwhere"}


class CaptureRefused(RuntimeError):
    """What a CUDA capture would refuse (a ``RuntimeError``, as torch raises it there)."""


def _aliases_input(func) -> bool:
    """A view (its output aliases an input, nothing written): not re-executed on replay."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class Tape(TorchDispatchMode):
    """The operations of one captured run, each with its arguments and the tensors it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            raise CaptureRefused("a captured graph reads a tensor's value on the host (.item(), int(), bool()): "
                                 "CUDA refuses this during capture")
        if name in SHAPE_FROM_VALUES:
            raise CaptureRefused(f"aten.{name} inside a captured graph: its output's shape depends on values")
        if _draws(func, args, kwargs):
            raise CaptureRefused(f"aten.{name} draws random numbers inside a captured graph: draw them outside "
                                 "and pass them in (the graph holds no generator)")
        out = func(*args, **kwargs)
        if not _aliases_input(func):
            self.ops.append((func, args, kwargs, out))
        return out


def _draws(func, args, kwargs) -> bool:
    """Whether an operation draws random numbers: tagged so, unless it is an attention kernel whose
    dropout is 0 (scaled_dot_product_attention carries the tag for its dropout)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = kwargs.get("dropout_p", args[i] if i < len(args) else func._schema.arguments[i].default_value)
    return bool(p)


def _garbage(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-7)


def tape_capture(run, pool, warmup: int = graphs.GRAPH_WARMUP):
    """``specdecpp.fast.graphs.capture_graph``'s CPU stand-in with a CUDA graph's rules (module docstring)."""
    for _ in range(warmup):  # warm-ups execute, as on CUDA (on a side stream there)
        run()
    tape = Tape()
    with tape:
        outputs = run()
    ops = tape.ops
    for t in outputs:  # a CUDA capture executes nothing: the outputs hold what the memory held
        _garbage(t)

    def replay():
        with torch.no_grad():
            for func, args, kwargs, out in ops:
                new = func(*args, **kwargs)
                for old, fresh in zip(tree_leaves(out), tree_leaves(new), strict=True):
                    if isinstance(old, torch.Tensor) and fresh is not old:
                        old.copy_(fresh)

    return replay, outputs


def rerun_capture(run, pool, warmup: int = graphs.GRAPH_WARMUP):
    """A looser stand-in for compiled steps: every replay reruns ``run`` and rewrites the captured
    outputs in place, as a CUDA graph's replay does (so a runner that handed out uncloned outputs fails)."""
    for _ in range(warmup):
        run()
    outputs = run()

    def replay():
        with torch.no_grad():
            for out, new in zip(outputs, run(), strict=True):
                out.copy_(new)

    return replay, outputs


COMPILED_CALLS = [0]  # calls of compiled steps while the fake is installed (install())


def fake_capture(run, pool, warmup: int = graphs.GRAPH_WARMUP):
    """The tape where ``run`` is eager; where its warm-ups called a compiled step (fast='compile-graphs'),
    which torch.compile refuses to run under a dispatch mode, the rerun."""
    before = COMPILED_CALLS[0]
    for _ in range(max(warmup, 1)):  # warm-ups execute, as on CUDA (on a side stream there)
        run()
    if COMPILED_CALLS[0] > before:
        return rerun_capture(run, pool, warmup=0)
    return tape_capture(run, pool, warmup=0)


def device_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``specdecpp.core.sampling.argmax``'s branch off a CPU (``max(-1).indices``, the first of ties,
    as numpy's argmax there): the CPU's numpy branch bypasses the dispatcher, so a tape would hold its
    capture-time result as a constant, where CUDA runs the kernel."""
    return logits.max(-1).indices


def install(monkeypatch) -> None:
    """fast='graphs' on the CPU with this fake: graphs allowed on a CPU, :func:`fake_capture` for
    ``capture_graph``, compiled steps counted (:data:`COMPILED_CALLS`), and captured code on its CUDA
    branches (the argmax where a round graph takes it, ``specdecpp.decoders.captured``, and where
    ``warp`` does)."""
    from specdecpp.core import sampling
    from specdecpp.decoders import captured

    monkeypatch.setattr(buckets, "GRAPHS_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(graphs, "capture_graph", fake_capture)
    for module in (captured, sampling):
        monkeypatch.setattr(module, "argmax", device_argmax)
    compile_step = compiling.compiled_step

    def counted(*args, **kwargs):
        fn = compile_step(*args, **kwargs)

        def call(*inputs):
            COMPILED_CALLS[0] += 1
            return fn(*inputs)

        return call

    monkeypatch.setattr(compiling, "compiled_step", counted)
