"""Inductor's FX graph cache for graphs that hold oneDNN-packed weights (issue 33, compile time).

Under the CPU's tuned settings (:data:`specdecpp.models.static.TUNED_COMPILE_OPTIONS`: freezing with
weight prepacking, the C++ GEMM template) freezing packs every linear layer's weight for oneDNN
before inductor looks up its FX graph cache. Packed weights are opaque ``mkldnn`` tensors, which
inductor cannot hash for the cache key, so it skips its cache ("Bypassing FX Graph Cache because
'mkldnn tensors unpickleable'") and every process compiled every bucket in full: 70-100 s per bucket
of a 135M-parameter Llama on a 2-core Intel Xeon, about five minutes for a fixed-K decoder's warm-up.

Only skipping the check is wrong. Inductor keys a frozen weight by its shape and dtype alone and takes
its values from the model at load time, but the C++ GEMM template copies each weight into its own
blocked layout while it compiles, and that copy is saved with the compiled graph. A second model of
the same shapes with other weights would load the first one's copies and compute with them (tested:
tests/models/test_packed_cache.py; research/compile_time/README.md).

:func:`packed_weights_cacheable` keys each packed weight by its values instead: the check lets
``mkldnn`` tensors through, and the cache key's pickler writes each one as its shape, dtype and a
BLAKE2b digest of its dense bytes (about 0.5 s per bucket of that Llama). The same weights give the
same key, so a later process, or another model object with the same weights, loads the bucket from
the cache; other weights miss and compile. Everything else about the key (the graph, the options,
torch's version) is inductor's own. The cache lives in inductor's cache directory
(``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_$USER``) and holds each bucket's blocked
weights: about the model's weight bytes per target bucket on disk (263 MB per bucket of that Llama).
On a 2-core Intel Xeon a later process loaded its one-token bucket in 28 s where a process compiled it
in 65-104 s, and a fixed-K decoder's five buckets in 96 s where they took 295 s (docs/results/fast.md).
Weights packed for MKL (float32 where the CPU has no bf16) carry uninitialised padding, so two packings
of the same weights digest differently: such a graph misses every time and compiles as before, never a
wrong hit.

Each patch is applied only where this torch has the function it replaces with the signature it
expects (both or none), and only while a step's first call compiles (``static.compiled_step``).
``SPECDECPP_PACKED_CACHE=0`` turns it off (inductor then skips its cache as before).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os

import torch

from .patching import PatchSet, takes_arguments

log = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether compiles key packed weights by value (``SPECDECPP_PACKED_CACHE=0`` turns it off)."""
    return os.environ.get("SPECDECPP_PACKED_CACHE", "1").strip() != "0"


def packed_key(t) -> tuple[str, tuple[int, ...], str, str]:
    """What the cache key holds for a packed (``mkldnn``) tensor: its shape, dtype and a digest of
    its values (the dense tensor's bytes)."""
    dense = t.to_dense().contiguous()
    digest = hashlib.blake2b(dense.reshape(-1).view(torch.uint8).numpy(), digest_size=16).hexdigest()
    return ("mkldnn", tuple(t.shape), str(t.dtype), digest)


def _patches() -> list[tuple[object, str, object, object]]:
    """(owner, attribute, original, replacement) for the cache's check and its key's tensor reducer,
    both or neither."""
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


_PATCHES = PatchSet(_patches, enabled)


def packed_weights_cacheable(on: bool | None = None):
    """Within it, inductor's FX graph cache keys oneDNN-packed weights by their values instead of
    skipping graphs that hold them (module docstring). ``on``: None follows :func:`enabled`; False
    does nothing."""
    return _PATCHES.applied(on)
