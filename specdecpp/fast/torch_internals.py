"""Every piece of the fast path that patches or calls past a private part of torch or transformers,
each switched by name (``SPECDECPP_TORCH_INTERNALS``). What each buys is measured in
docs/results/fast.md; how each works is in docs/engine.md ("Patches of torch internals").

Compile time, OFF by default (they change nothing a decode computes, only how long a bucket takes
to compile or whether a later process finds it in inductor's FX graph cache):

- ``codegen_memo``: while a step compiles, ``KernelTemplate._template_from_string`` and
  ``cpp_template_kernel.parse_expr_with_index_symbols`` keep their results by their text (inductor
  compiles the same jinja templates and parses the same index expressions thousands of times per
  bucket under the CPU's tuned settings). The same generated code, less compile time.
- ``packed_cache``: while a step compiles, ``CacheabilityValidator.check_tensor`` lets oneDNN-packed
  (``mkldnn``) weights through and ``FxGraphCachePickler._reduce_tensor`` keys each one by a digest
  of its values, so a tuned bucket is saved to inductor's FX graph cache and a later process loads it
  (inductor alone skips such graphs). This changes inductor's cache keys of those graphs.

Decode time, ON by default for now (to be measured against the default path, scripts/compare_checkouts.py):

- ``direct_call``: a compiled step's later calls skip dynamo and call the graph inductor compiled on
  the first call (kept by a subclass of the private ``torch._TorchCompileInductorWrapper``), checked
  once bit for bit against dynamo's output and only under the global state it compiled under
  (``torch._C._dynamo.guards.GlobalStateGuard``). Off: every call goes through dynamo (with its guard
  evaluation skipped by the public ``torch.compiler.set_stance``).
- ``config_dict``: the static runners' swap of the CPU attention around each forward writes the
  config's instance dict (``_attn_implementation_internal``) instead of going through transformers'
  config attribute protocol (some sixty Python calls a forward). Off: the public setter
  ``config._attn_implementation``.

``SPECDECPP_TORCH_INTERNALS`` is read left to right from the default set: a piece's name turns it on,
``-name`` off, ``all`` turns every piece on, ``none`` every piece off, ``default`` gives the default
set again; e.g. ``=codegen_memo,packed_cache`` (the defaults plus both compile-time pieces),
``=all``, ``=none``, ``=-direct_call``. Each patch checks that what it replaces exists with the
signature it expects and leaves torch as it is otherwise (said at DEBUG level);
tests/models/test_torch_internals.py fails when one of them has moved on the installed torch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import threading
from collections.abc import Callable

import torch

from ..core.attention import CPU_ATTENTION

log = logging.getLogger(__name__)

ENV = "SPECDECPP_TORCH_INTERNALS"
COMPILE_TIME = ("codegen_memo", "packed_cache")
DECODE_TIME = ("direct_call", "config_dict")
PIECES = (*COMPILE_TIME, *DECODE_TIME)
DEFAULT = DECODE_TIME


def chosen(value: str | None = None) -> frozenset[str]:
    """The pieces in force for ``value`` (None: the environment variable; module docstring)."""
    value = os.environ.get(ENV, "default") if value is None else value
    on = set(DEFAULT)
    for word in (w.strip() for w in value.split(",")):
        name = word.removeprefix("-")
        if not word:
            continue
        if word == "default":
            on = set(DEFAULT)
        elif word in ("all", "none"):
            on = set(PIECES) if word == "all" else set()
        elif name in PIECES:
            (on.discard if word.startswith("-") else on.add)(name)
        else:
            raise ValueError(f"{ENV}={value!r}: unknown piece {word!r}; name pieces of {', '.join(PIECES)} "
                             "(-name turns one off), or all, none, default")
    return frozenset(on)


def enabled(piece: str) -> bool:
    """Whether ``piece`` (one of :data:`PIECES`) is on."""
    if piece not in PIECES:
        raise ValueError(f"unknown piece {piece!r}; the pieces are {', '.join(PIECES)}")
    return piece in chosen()


# -- patches applied while a block runs (the compile-time pieces) -----------------------------------------

_LOCK = threading.Lock()  # one patcher at a time, whichever set


def takes_arguments(fn, n: int) -> bool:
    """Whether ``fn`` has exactly ``n`` parameters (False where its signature cannot be read)."""
    try:
        return len(inspect.signature(fn).parameters) == n
    except (TypeError, ValueError):
        return False


class PatchSet:
    """The patches ``make()`` lists as (owner, attribute, original, replacement) (each only where
    this torch has the function as expected), applied when the outermost block of :meth:`applied`
    is entered and undone when it ends, after an error too; nested or concurrent blocks patch once."""

    def __init__(self, piece: str, make: Callable[[], list[tuple[object, str, object, object]]]) -> None:
        self.piece, self.make, self.depth = piece, make, 0

    @contextlib.contextmanager
    def applied(self, on: bool | None = None):
        """The patches applied while the block runs. ``on``: None follows :func:`enabled`; False does nothing."""
        if not (enabled(self.piece) if on is None else on):
            yield
            return
        with _LOCK:
            patches = self.make() if self.depth == 0 else []
            for owner, name, _, replacement in patches:
                setattr(owner, name, replacement)
            self.depth += 1
        try:
            yield
        finally:
            with _LOCK:
                self.depth -= 1
                for owner, name, original, _ in patches:
                    setattr(owner, name, original)


_TEMPLATES: dict[str, object] = {}  # a jinja template's source -> the template inductor compiled from it
_EXPRESSIONS: dict[str, object] = {}  # an index expression's text -> the sympy expression inductor parsed


def _by_text(fn, memo: dict):
    """``fn`` with its result kept in ``memo`` by its argument where that is a string (anything else
    goes to ``fn`` as it is: a sympy expression, a list of texts)."""
    def by_text(arg):
        if not isinstance(arg, str):
            return fn(arg)
        found = memo.get(arg)
        if found is None:
            found = memo[arg] = fn(arg)
        return found

    return by_text


def codegen_patches() -> list[tuple[object, str, object, object]]:
    """``codegen_memo``'s patches, for each function this torch has as expected."""
    try:
        import torch._inductor.compile_fx  # noqa: F401 (imports the codegen modules in the order their cycle needs)
        from torch._inductor.codegen import common, cpp_template_kernel
    except ImportError as exc:
        log.debug("no inductor codegen to memoise (%s)", exc)
        return []
    out = []
    template = getattr(common, "KernelTemplate", None)
    original = inspect.getattr_static(template, "_template_from_string", None) if template is not None else None
    if isinstance(original, staticmethod) and takes_arguments(original.__func__, 1):
        out.append((template, "_template_from_string", original,
                    staticmethod(_by_text(original.__func__, _TEMPLATES))))
    parse = getattr(cpp_template_kernel, "parse_expr_with_index_symbols", None)
    if parse is not None and takes_arguments(parse, 1):  # a list's items come back through the patched name
        out.append((cpp_template_kernel, "parse_expr_with_index_symbols", parse, _by_text(parse, _EXPRESSIONS)))
    return out


def packed_key(t) -> tuple[str, tuple[int, ...], str, str]:
    """What the cache key holds for a packed (``mkldnn``) tensor: its shape, dtype and a digest of
    its values (the dense tensor's bytes)."""
    dense = t.to_dense().contiguous()
    digest = hashlib.blake2b(dense.reshape(-1).view(torch.uint8).numpy(), digest_size=16).hexdigest()
    return ("mkldnn", tuple(t.shape), str(t.dtype), digest)


def packed_patches() -> list[tuple[object, str, object, object]]:
    """``packed_cache``'s patches of the cache's check and its key's tensor reducer, both or neither."""
    try:
        from torch._inductor import codecache
    except ImportError as exc:
        log.debug("no inductor FX graph cache to patch (%s)", exc)
        return []
    validator = getattr(codecache, "CacheabilityValidator", None)
    pickler = getattr(codecache, "FxGraphCachePickler", None)
    ident = getattr(codecache, "_ident", None)
    check = inspect.getattr_static(validator, "check_tensor", None) if validator is not None else None
    reduce = inspect.getattr_static(pickler, "_reduce_tensor", None) if pickler is not None else None
    if not (isinstance(check, staticmethod) and takes_arguments(check.__func__, 1) and callable(reduce)
            and takes_arguments(reduce, 2) and callable(ident)):
        log.debug("this torch's FX graph cache is not the one packed_cache patches: left as it is")
        return []
    original_check = check.__func__

    def check_tensor(t):
        if not getattr(t, "is_mkldnn", False):
            original_check(t)

    def reduce_tensor(self, t):
        if getattr(t, "is_mkldnn", False):
            try:
                key = packed_key(t)
            except Exception as exc:  # a packed tensor with no dense form: skip the cache, as inductor does
                log.debug("packed weight %s not keyed by value (%s): inductor skips the cache", tuple(t.shape), exc)
                original_check(t)
                raise
            return (ident, (key,))
        return reduce(self, t)

    return [(validator, "check_tensor", check, staticmethod(check_tensor)),
            (pickler, "_reduce_tensor", reduce, reduce_tensor)]


_CODEGEN = PatchSet("codegen_memo", codegen_patches)
_PACKED = PatchSet("packed_cache", packed_patches)


def memoised_codegen(on: bool | None = None):
    """``codegen_memo`` while the block runs (module docstring). ``on``: None follows :func:`enabled`."""
    return _CODEGEN.applied(on)


def packed_weights_cacheable(on: bool | None = None):
    """``packed_cache`` while the block runs (module docstring). ``on``: None follows :func:`enabled`."""
    return _PACKED.applied(on)


@contextlib.contextmanager
def compile_patches():
    """What a step's first call compiles under: the compile-time pieces that are on."""
    with memoised_codegen(), packed_weights_cacheable():
        yield


# -- direct_call -----------------------------------------------------------------------------------------

def keeping_backend(options: dict, graphs: list):
    """torch.compile's own inductor backend with ``options`` that also appends what it compiles,
    ``(callable, example inputs)``, to ``graphs``; None where ``direct_call`` is off or this torch
    has no such backend class to extend."""
    base = getattr(torch, "_TorchCompileInductorWrapper", None)
    if base is None or not enabled("direct_call"):
        return None
    return _kept_graphs(base)(options, graphs)


@functools.cache
def _kept_graphs(base: type) -> type:
    class _KeptGraphs(base):
        def __init__(self, options: dict, graphs: list) -> None:
            super().__init__(None, options or None, False)
            self.options, self.graphs = options or None, graphs

        def __call__(self, model_, inputs_, **kwargs):
            fn = super().__call__(model_, inputs_, **kwargs)
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
    """A step's compiled graph called as dynamo's compiled code calls it, without dynamo.
    ``graphs[-1]`` is what inductor compiled on the first call ``args``, which returned ``out``: its
    example inputs are matched by identity to the call's :func:`step_tensors` (the rest, the model's
    weights and buffers, are held as they are), and the graph is called once more with ``args``,
    which writes the same keys and values to the same slots again and must return ``out`` bit for
    bit. Returns ``(*args) -> (logits, hidden)``, replaying the one side effect dynamo replays that
    matters (``cache.slots``), with ``state``: dynamo's check of the global state the graph compiled
    under; or None where the match or the check fails (said at DEBUG level), or this torch has no
    such check: dynamo then calls the graph as before."""
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
    if len(again) != len(out) or not all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                                         and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                                         for a, b in zip(again, out, strict=True)):
        log.debug("%s: its graph called directly returned other outputs; calls go through dynamo", name)
        return None
    call.state = state.GlobalStateGuard()  # a call under another global state goes through dynamo, which refuses it
    return call


# -- config_dict -----------------------------------------------------------------------------------------

STORED = "_attn_implementation_internal"  # where transformers keeps ``config._attn_implementation`` (4.36 through 5.x)


class SwapStored:
    """The CPU attention's swap written straight into a config's instance ``__dict__``: a dictionary
    read and, on sdpa, two writes. One instance per forward (a nested forward enters one of its own)."""

    __slots__ = ("state", "swapped")

    def __init__(self, state: dict) -> None:
        self.state, self.swapped = state, False

    def __enter__(self) -> None:
        if self.state.get(STORED) == "sdpa":
            self.state[STORED] = CPU_ATTENTION
            self.swapped = True

    def __exit__(self, *exc) -> None:
        if self.swapped:
            self.state[STORED] = "sdpa"


def stored_directly(config) -> bool:
    """Whether ``config._attn_implementation`` reads its instance dict's :data:`STORED` entry and
    nothing else depends on it (no sub-configs, whose setter the swap would skip): checked by
    writing a probe there and reading it back through the attribute, then restoring it."""
    state = getattr(config, "__dict__", None)
    if state is None or STORED not in state or getattr(config, "sub_configs", None):
        return False
    saved = state[STORED]
    try:
        state[STORED] = "specdecpp-probe"
        return getattr(config, "_attn_implementation", None) == "specdecpp-probe"
    finally:
        state[STORED] = saved


def swap_by_dict(swap, config):
    """``swap`` (``core.attention.attention_swap``'s) as :class:`SwapStored` over ``config``'s
    instance dict where ``config_dict`` is on, ``swap`` swaps something and the config keeps its
    attention there (:func:`stored_directly`); else ``swap`` itself."""
    if swap is contextlib.nullcontext or not enabled("config_dict") or not stored_directly(config):
        return swap
    return functools.partial(SwapStored, config.__dict__)
