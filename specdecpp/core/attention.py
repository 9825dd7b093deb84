"""The attention kernels a decoder's forwards use: on CUDA not cuDNN's, which builds a plan for
every new query/key length (:func:`decode_attention`, and :func:`decoding` for a ``generate``,
which also turns autograd off); on a CPU, inside the static runners' forwards, two matrix products
in place of PyTorch's fused kernel (:func:`cpu_attention`, :func:`static_attention`)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

# Which scaled-dot-product-attention kernels decoding may use on CUDA (environment variable):
# "no-cudnn" (default) or "default" (PyTorch's own choice, cuDNN's kernel first on recent GPUs).
SDPA_ENV = "SPECDECPP_SDPA"
SDPA_CHOICES = ("no-cudnn", "default")


def decode_attention(device) -> contextlib.AbstractContextManager:
    """The attention kernels for decoding on ``device``: on CUDA, flash, memory-efficient or math
    attention, not cuDNN's. PyTorch prefers cuDNN's kernel on Hopper GPUs, and it builds (and
    caches) an execution plan for every new query and key length: speculative decoding meets a new
    pair in nearly every forward (the key length grows by a round's accepted tokens, the query
    length is the round's K + 1), so each first visit costs milliseconds of host time, and a method
    run after another that already visited the same lengths looks faster than it is
    (docs/gpu.md, "Fixed K on CUDA"). Set ``SPECDECPP_SDPA=default`` to leave the choice to
    PyTorch. A no-op on CPU. The flags are process-wide while the context is open (PEARL's
    drafting thread sees them too)."""
    choice = os.environ.get(SDPA_ENV, SDPA_CHOICES[0])
    if choice not in SDPA_CHOICES:
        raise ValueError(f"{SDPA_ENV} must be one of {', '.join(SDPA_CHOICES)}, got {choice!r}")
    if torch.device(device).type != "cuda" or choice == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def decoding(method):
    """Decorator for a decoder's ``generate``: runs it without autograd and under
    :func:`decode_attention` of the decoder's ``self.device``."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch.no_grad(), decode_attention(self.device):
            return method(self, *args, **kwargs)

    return run


# The static runners' attention on a CPU (specdecpp.fast): registered with transformers'
# AttentionInterface under this name, and put in place of "sdpa" only around their forwards.
CPU_ATTENTION = "specdecpp_cpu"
_UNSUPPORTED = ("softcap", "s_aux", "sinks")  # attention features this function leaves to sdpa


def cpu_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling=None,
                  dropout: float = 0.0, **kwargs):
    """Attention of a few query tokens over a static cache on a CPU, as transformers' attention
    interface calls it (``query`` [B, H, q, D], ``key``/``value`` [B, H_kv, L, D], an additive 4-D
    ``attention_mask``): two matrix products and a softmax in float32, each group of query heads
    against its key-value head, which is not repeated per head. PyTorch's fused CPU kernel takes 4-8x
    as long for one query token over a few hundred cached positions (research/cpu_kernels), which
    is every decoding forward; the arithmetic is the same attention, in float32 throughout (the
    kernel's scores are no more precise). Returns ``(output [B, q, H, D], None)``; anything else (dropout, soft-capping,
    sinks) goes to transformers' sdpa."""
    if dropout or any(kwargs.get(k) is not None for k in _UNSUPPORTED):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kwargs)
    batch, heads, q, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query.reshape(batch, kv_heads, group * q, dim).float(), key.float().transpose(-1, -2))
    scores = scores.mul_(scale).view(batch, kv_heads, group, q, -1)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, : scores.shape[-1]].float()
    probs = scores.softmax(-1).view(batch, kv_heads, group * q, -1)
    out = torch.matmul(probs, value.float()).view(batch, heads, q, dim).to(query.dtype)
    return out.transpose(1, 2), None


@functools.cache
def _cpu_attention_registered() -> bool:
    try:
        from transformers import AttentionInterface
    except ImportError:  # a transformers without the attention interface: sdpa stays
        return False
    AttentionInterface.register(CPU_ATTENTION, cpu_attention)
    return True


def attention_swap(config, device):
    """What a static runner enters around each forward (decided once, when it is built): a
    callable returning a context manager with :func:`static_attention`'s effect, or
    :class:`contextlib.nullcontext` off a CPU or where this transformers has no attention interface.
    Whether the model is on sdpa is read on every entry, so a model switched to another attention
    later is left alone. (The fast path may swap it cheaper: ``specdecpp.fast.torch_internals``,
    ``config_dict``.)"""
    if torch.device(device).type != "cpu" or not _cpu_attention_registered():
        return contextlib.nullcontext
    return functools.partial(static_attention, config, device)


@contextlib.contextmanager
def static_attention(config, device):
    """Around a static runner's forward (specdecpp.fast): on a CPU, a model on transformers'
    sdpa attention runs :func:`cpu_attention` instead, and gets sdpa back after (the eager runner,
    and anything else holding the model, never sees the change). A compiled step traced inside it
    keeps the choice (dynamo guards on it, and every call is inside it again). Elsewhere a no-op."""
    if torch.device(device).type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa" \
            or not _cpu_attention_registered():
        yield
        return
    config._attn_implementation = CPU_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
