"""The attention kernels a decoder's forwards use on CUDA (not cuDNN's, which builds a plan for
every new query/key length): :func:`decode_attention`, and :func:`decoding` for a ``generate``
(which also turns autograd off)."""

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
