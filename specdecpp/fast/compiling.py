"""A bucket's step compiled by inductor, once per model, bucket and cache size for the process
(:func:`compiled_step`), with the inductor settings of its device type (:data:`COMPILE_OPTIONS`,
:func:`set_compile_options`; docs/engine.md, "Compile settings on a CPU"). A step's later calls run
under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (docs/engine.md, "Guards") and, where
``direct_call`` is on, call inductor's graph past dynamo (:mod:`~specdecpp.fast.torch_internals`)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import warnings

import torch

from . import torch_internals
from .step import ModelSteps, model_steps, own_code

log = logging.getLogger(__name__)

# torch.compiler.set_stance(skip_guard_eval_unsafe=) came with torch 2.6; before it, every guard is evaluated
CAN_SKIP_GUARDS = ("skip_guard_eval_unsafe"
                   in inspect.signature(getattr(torch.compiler, "set_stance", lambda: None)).parameters)
# inductor's settings for fast="compile" by device type, none elsewhere (docs/engine.md, "Compile settings on a CPU");
# read when a bucket compiles (set_compile_options changes them)
TUNED_COMPILE_OPTIONS: dict[str, dict] = {
    "cpu": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", "narrow_gemm_rows": 4}}
COMPILE_OPTIONS: dict[str, dict] = {k: dict(v) for k, v in TUNED_COMPILE_OPTIONS.items()}
NARROW_KEY = "narrow_gemm_rows"  # the project's own option (not inductor's): see narrow_options
NO_GEMM_CHOICE = "No choices to select"  # inductor's NoValidChoicesError: no backend it was given serves a GEMM


def compiled_step(model, step, key: tuple, name: str, steps: ModelSteps | None = None, options: dict | None = None):
    """``step`` (``static_step`` or ``batch_step``) compiled for ``model``'s bucket ``key``
    (the widths, then the cache size: (width, size) for a row, (width, size, batch) for a batch),
    once per process: ``torch.compile(fullgraph=True, dynamic=False)`` of a copy with a code object
    of its own named ``name`` (:func:`~specdecpp.fast.step.own_code`) with the :data:`COMPILE_OPTIONS` of the model's
    device type (or ``options``), compiled on its first call, which is timed into
    ``model_steps(model).compile_seconds[key]`` (or ``steps``: what a runner keeps, ``StaticModel.steps``)."""
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
    direct = None  # the compiled graph called without dynamo (torch_internals, direct_call), once checked

    def unguarded(*args):  # later calls: guards skipped (the public set_stance), dynamo skipped (direct_call)
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
                torch_internals.compile_patches():
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
        direct = torch_internals.direct_call(graphs, args, out, name) if graphs else None
        steps.compiled[key] = unguarded
        log.info("compiled %s of %s in %.1f s", name, type(model).__name__, steps.compile_seconds[key])
        return out

    steps.compiled[key] = first
    return first


def _compile(step, name: str, options: dict, graphs: list):
    """``torch.compile(fullgraph=True, dynamic=False)`` of a copy of ``step`` named ``name`` with
    inductor and ``options``; where ``direct_call`` is on, through the backend that also appends each
    graph it compiles to ``graphs`` (:func:`~specdecpp.fast.torch_internals.keeping_backend`)."""
    code = own_code(step, name)
    backend = torch_internals.keeping_backend(options, graphs)
    if backend is None:
        return torch.compile(code, fullgraph=True, dynamic=False, options=options or None)
    return torch.compile(code, fullgraph=True, dynamic=False, backend=backend)


def narrow_options(options: dict, rows: int) -> dict:
    """The inductor options a bucket of ``rows`` rows (width x batch) compiles with: ``options``
    without the project's own key ``narrow_gemm_rows``, and where that key is set and ``rows`` is at
    most it, with the C++ GEMM template alone (``max_autotune_gemm_backends="CPP"``). The CPU's tuned
    settings set it to 4: inductor's autotuning times each GEMM with its weight in the cache, where a
    forward streams it from memory, and at four rows it picked kernels 20% slower than the
    template's; from eight rows up the template alone is 2-4x slower (docs/engine.md, "Compile
    settings on a CPU"). A ``compile_options`` mapping without the key autotunes every bucket."""
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
    lines per bucket) and warns that TypedStorage is deprecated; keep them off unless this logger
    is at DEBUG level (inductor's configs ``autotune_num_choices_displayed`` and
    ``max_autotune_report_choices_stats``, where this torch has them)."""
    if not options.get("max_autotune") or log.isEnabledFor(logging.DEBUG):
        yield
        return
    import torch._inductor.config as inductor_config

    quiet = {k: v for k, v in (("max_autotune_report_choices_stats", False), ("autotune_num_choices_displayed", 0))
             if hasattr(inductor_config, k)}
    with inductor_config.patch(**quiet), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)  # inductor's autotuner, per GEMM
        yield


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
