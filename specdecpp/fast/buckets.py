"""The fast path's switch and its shapes: the ``fast`` backends, the width and batch buckets a
forward is padded to, the cache size a call gets, and the checks of a ``fast`` argument and of a
model the static cache can serve (docs/engine.md, "The fast path")."""

from __future__ import annotations

import torch

from ..core.attention import CPU_ATTENTION

TARGET_BUCKETS = (1, 2, 4, 8, 16, 32)
DRAFT_BUCKETS = (1, 2)
FAST_BACKENDS = (None, "static", "compile", "graphs", "compile-graphs")
GRAPH_BACKENDS = ("graphs", "compile-graphs")  # the backends that capture CUDA graphs (on static KV buffers)
BUCKETED_BACKENDS = ("compile", *GRAPH_BACKENDS)  # the backends whose buckets warm_up compiles or captures
# the backends whose buckets inductor compiles (a minute or more on a CPU)
COMPILING_BACKENDS = ("compile", "compile-graphs")
GRAPHS_DEVICE_TYPES = ("cuda",)  # where the graph backends run (tests add "cpu" beside a fake capture_graph)
BATCH_BUCKETS = (1, 2, 4, 8, 16)
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
                         f"{getattr(config, 'sliding_window', None)}; "
                         "the static cache holds full-attention layers only; "
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
