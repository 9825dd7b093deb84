"""The caches the project owns: :class:`StaticKV`, one row's preallocated keys and values per
layer, and :class:`RowWindow`, what one batched forward of the batch runner sees. The model writes a
forward's keys and values at the slots its step hands over (``cache.slots``); the 4-D additive mask
hides every slot at or above the length, so a rollback moves the length and a compaction is an
index copy (docs/engine.md, "An owned cache")."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CachedLayer:
    """One layer's valid keys and values [1, kv_heads, length, head_dim] (views into the buffers)."""

    keys: torch.Tensor
    values: torch.Tensor


def forward_slots(cache) -> torch.Tensor:
    """The slots the forward now running writes, as its step handed them to ``cache``."""
    slots = cache.slots
    if slots is None:
        raise RuntimeError(f"{type(cache).__name__}.update() called outside a static step (no slots handed over)")
    return slots


def check_layer_shape(layer_idx: int, key_states: torch.Tensor, keys: torch.Tensor) -> None:
    if key_states.shape[1] != keys.shape[1] or key_states.shape[-1] != keys.shape[-1]:
        raise ValueError(f"layer {layer_idx} gave keys {tuple(key_states.shape)}; the static cache holds "
                         f"{tuple(keys.shape)} (kv heads and head_dim from the model's config)")


def kv_buffers(config, rows: int, size: int, dtype: torch.dtype, device) -> tuple[list, list]:
    """Zeroed keys and values per layer, [rows, kv_heads, size, head_dim] each."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (rows, heads, size, head_dim)
    return ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)])


class StaticKV:
    """Preallocated keys and values per layer, written by the model at the slots it is given
    (module docstring); ``length`` of them are valid. The runner owns ``length``."""

    is_compileable = True  # read by some transformers mask code; never reached with our 4-D masks

    def __init__(self, config, size: int, dtype: torch.dtype, device, buffers: tuple | None = None) -> None:
        self.keys, self.values = buffers or kv_buffers(config, 1, size, dtype, device)  # buffers: a GraphSet's
        self.size, self.length = size, 0
        self.slots: torch.Tensor | None = None  # the running forward's slots [W], handed over by its step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None, *, kwargs: dict | None = None):
        """Write a forward's keys and values [1, kv_heads, W, head_dim] at its slots [W] (what its
        step handed over); return the layer's whole buffers (the mask hides what is not valid)."""
        slots = forward_slots(self)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        check_layer_shape(layer_idx, key_states, keys)
        keys.index_copy_(2, slots, key_states)
        values.index_copy_(2, slots, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def layers(self) -> list[CachedLayer]:
        """Each layer's valid entries, as ``DynamicCache.layers`` shows them (for comparisons)."""
        return [CachedLayer(k[:, :, : self.length], v[:, :, : self.length])
                for k, v in zip(self.keys, self.values, strict=True)]

    def compact(self, keep: list[int]) -> None:
        """Move the slots ``keep`` (checked by the runner) to the front, in order, with one index
        copy per buffer; slots before the first gap stay put. ``length`` becomes ``len(keep)``."""
        first = next((i for i, k in enumerate(keep) if k != i), len(keep))
        if first < len(keep):
            src = torch.tensor(keep[first:], device=self.keys[0].device)
            for buf in (*self.keys, *self.values):
                buf[:, :, first : len(keep)] = buf.index_select(2, src)
        self.length = len(keep)


def check_keep(keep, length: int) -> list[int]:
    """``keep`` as a list of strictly increasing cache positions below ``length``, or a ValueError."""
    keep = [int(k) for k in keep]
    if any(b <= a for a, b in zip(keep, keep[1:], strict=False)) or (keep and (keep[0] < 0 or keep[-1] >= length)):
        raise ValueError(f"compact: keep must be strictly increasing cache positions < {length}, got {keep}")
    return keep


class RowWindow:
    """The cache one batched forward of :class:`~specdecpp.fast.batch_runner.StaticBatchRunner` sees: per
    layer ``keys``/``values``, either views of the first B rows of the runner's buffers [B,
    kv_heads, size, head_dim] (``rows`` None: the forward's row i is buffer row i, written and read
    in place) or the whole buffers with ``rows`` [B] naming the buffer row of each forward row
    (written in place, read as a gathered copy of their first ``span`` slots: the eager prefill of
    joining rows, whose tokens all lie below ``span``)."""

    is_compileable = True  # read by some transformers mask code; never reached with our 4-D masks

    def __init__(self, keys: list, values: list, rows: torch.Tensor | None = None, span: int | None = None) -> None:
        self.keys, self.values, self.rows, self.span = keys, values, rows, span
        self.slots: torch.Tensor | None = None  # the running forward's slots [B, W], handed over by its step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None, *, kwargs: dict | None = None):
        """Write a forward's keys and values [B, kv_heads, W, head_dim] at its slots [B, W] (each
        row its own); return the buffers its attention reads [B, kv_heads, size (or span), head_dim]."""
        slots = forward_slots(self)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        check_layer_shape(layer_idx, key_states, keys)
        rows = torch.arange(key_states.shape[0], device=slots.device) if self.rows is None else self.rows
        keys[rows[:, None], :, slots] = key_states.transpose(1, 2)
        values[rows[:, None], :, slots] = value_states.transpose(1, 2)
        if self.rows is None:
            return keys, values
        return keys[:, :, : self.span].index_select(0, self.rows), values[:, :, : self.span].index_select(0, self.rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and slots are always passed; never read
