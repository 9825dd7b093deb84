"""The fast path: the project's own static KV cache, forwards padded to width buckets, each
bucket's step run eagerly, compiled by inductor or captured as a CUDA graph, chosen by one switch
``fast`` (None, "static", "compile", "graphs", "compile-graphs"); docs/engine.md, "The fast path".

- :mod:`~specdecpp.fast.buckets`: the backends, the buckets, the cache size a call gets, the checks;
- :mod:`~specdecpp.fast.kv`: the owned caches (``StaticKV``, ``RowWindow``);
- :mod:`~specdecpp.fast.step`: the pure step and what is kept of a model for the process;
- :mod:`~specdecpp.fast.compiling`: a bucket's step compiled, inductor's settings;
- :mod:`~specdecpp.fast.graphs`: CUDA graphs per bucket;
- :mod:`~specdecpp.fast.runners`, :mod:`~specdecpp.fast.batch_runner`: the one-row and the batch runner;
- :mod:`~specdecpp.fast.calls`: a decoder's runners across its calls (``CallRunners``, ``new_runner``);
- :mod:`~specdecpp.fast.features`: a feature pair's target, its steps returning the draft's features;
- :mod:`~specdecpp.fast.torch_internals`: every patch of a torch or transformers internal, by name.
"""

from .batch_runner import StaticBatchRunner
from .buckets import (
    DRAFT_BUCKETS,
    FAST_BACKENDS,
    GRAPH_BACKENDS,
    TARGET_BUCKETS,
    check_fast,
    fit_buckets,
)
from .calls import CallRunners, new_runner
from .compiling import COMPILE_OPTIONS, TUNED_COMPILE_OPTIONS, set_compile_options
from .kv import StaticKV
from .runners import StaticRunner
from .step import model_steps

__all__ = [
    "COMPILE_OPTIONS", "DRAFT_BUCKETS", "FAST_BACKENDS", "GRAPH_BACKENDS", "TARGET_BUCKETS", "TUNED_COMPILE_OPTIONS",
    "CallRunners", "StaticBatchRunner", "StaticKV", "StaticRunner", "check_fast", "fit_buckets", "model_steps",
    "new_runner", "set_compile_options",
]
