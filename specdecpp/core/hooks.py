"""What a forward pass needs around the model: the logits kept (gathered, not sliced), the final
hidden state captured by a hook, an empty KV cache and its rollback."""

from __future__ import annotations

import torch


def new_cache(model):
    """An empty KV cache for ``model`` (transformers' DynamicCache)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)  # transformers >= 4.56 (pyproject.toml)


def crop_to(cache, length: int) -> None:
    """Roll a KV cache back to its first ``length`` tokens (no-op if fewer are cached; ``crop``
    takes the number to remove, negated)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def keep_last(total: int, k: int, device) -> int | torch.Tensor:
    """``logits_to_keep`` for the last ``k`` of ``total`` positions of a batch-1 forward.

    transformers slices the final hidden state as ``hidden[:, -k:, :]``; for one row that is a
    [1, k, H] view whose batch stride is total * H, which PyTorch calls contiguous but oneDNN's
    bf16 GEMM on CPU does not take its fast path for: a 576-wide, 49,152-token output layer then costs
    ~70 ms instead of ~3 ms (the whole bf16 forward over 4 tokens 94 ms instead of 29 ms). An
    index tensor makes transformers gather the rows into a fresh tensor instead. Keeping every
    position (k >= total) stays the plain int (no slice is taken)."""
    if k >= total:
        return k
    return torch.arange(total - k, total, device=device)


class GatherKeptLogits:
    """While active, an integer ``logits_to_keep`` that any of ``models`` receives from code we do
    not control (transformers' own ``generate``, e.g. assisted generation's draft calls, which feed
    2-3 new tokens and keep 1 logit) is replaced by :func:`keep_last`'s index tensor: the same rows,
    gathered instead of sliced, so oneDNN's bf16 fast path applies. ``with GatherKeptLogits(draft,
    target): target.generate(...)``; the hooks are removed on exit."""

    def __init__(self, *models) -> None:
        self.models = models
        self.handles: list = []

    @staticmethod
    def _hook(module, args, kwargs):
        k = kwargs.get("logits_to_keep")
        if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        ref = ids if ids is not None else kwargs.get("inputs_embeds")
        if ref is None or ref.shape[0] != 1:
            return None
        return args, {**kwargs, "logits_to_keep": keep_last(ref.shape[1], k, ref.device)}

    def __enter__(self) -> GatherKeptLogits:
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self.models]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class FinalHidden:
    """Captures a causal LM's final hidden state (after the final norm) through a forward hook on
    its decoder, so the model runs without ``output_hidden_states`` (which keeps every layer's
    states). ``with FinalHidden(model) as h: model(...); h.value`` -> [B, L, H]. A model without a
    ``get_decoder()`` falls back to ``output_hidden_states`` (``h.kwargs`` says which to pass)."""

    def __init__(self, model) -> None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        self.decoder = decoder if isinstance(decoder, torch.nn.Module) and decoder is not model else None
        self.kwargs = {} if self.decoder is not None else {"output_hidden_states": True}
        self.value: torch.Tensor | None = None
        self._handle = None

    def _hook(self, module, args, output) -> None:
        self.value = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def take(self, out) -> torch.Tensor:
        """The final hidden state of the forward that returned ``out``."""
        return out.hidden_states[-1] if self.decoder is None else self.value

    def __enter__(self) -> FinalHidden:
        if self.decoder is not None:
            self._handle = self.decoder.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.value = None
