"""The step every static forward runs: :func:`batch_step` (and :func:`static_step`, its one-row
form), a pure function of the model's decoder and output layer, the cache and the forward's tensors,
so that ``torch.compile(fullgraph=True)`` takes it whole; and what the fast path keeps of a model for
the whole process (:func:`model_steps`: compiled steps, compile and capture times, graph sets)."""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass, field

import torch


def batch_step(decoder, head, cache_arg: str, cache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over B rows of W tokens ``ids`` [B, W] at RoPE ``positions`` [B, W]: their keys
    and values go to the ``cache``'s ``slots``, attention follows ``mask`` [B, 1, W, size]
    (additive). Returns the logits [B, W, V] and the final hidden state [B, W, H]. A function of its
    inputs (the cache buffers are written in place), so it compiles whole. It hands ``slots`` to the
    cache (``cache.slots``) for the forward's ``update`` calls: transformers 5.17 passes no
    ``cache_position`` to ``update``. Under ``torch.compile`` that attribute is a side effect that
    dynamo replays after the graph; under CUDA graphs it is set at capture to the captured step's own
    slots tensor, which every replay refills."""
    cache.slots = slots
    out = decoder(input_ids=ids, position_ids=positions, attention_mask=mask, cache_position=slots,
                  use_cache=True, **{cache_arg: cache})
    hidden = out.last_hidden_state
    return head(hidden), hidden


def static_step(decoder, head, cache_arg: str, cache, ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`batch_step` of one row: ``ids`` and ``positions`` [W], ``slots`` [W] in the cache,
    ``mask`` [1, 1, W, size]; returns the logits [W, V] and the final hidden state [W, H]."""
    logits, hidden = batch_step(decoder, head, cache_arg, cache, ids[None], positions[None], slots, mask)
    return logits[0], hidden[0]


def own_code(fn, name: str):
    """``fn`` with a code object of its own: dynamo keeps compiled variants per code object, so
    each bucket of each model compiles as a first compile rather than a recompile (dynamo would
    count every bucket and model as a recompile of one function, whose limit is 8)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass
class ModelSteps:
    """What a model's fast path keeps for the whole process: its compiled steps by (bucket, cache
    size) or (bucket, cache size, batch bucket) (:func:`~specdecpp.fast.compiling.compiled_step`), the seconds
    each took to
    compile on first use, whether the wide-forward and the many-rows warnings were given."""

    compiled: dict = field(default_factory=dict)
    compile_seconds: dict = field(default_factory=dict)
    warned_wide: bool = False
    warned_rows: bool = False
    # (size, dtype, device) -> additive causal mask [size, size] (StaticRunner)
    causal: dict = field(default_factory=dict)
    chain_inputs: dict = field(default_factory=dict)  # (size, dtype, device, start, width) -> (slots, positions, mask)
    graph_sets: dict = field(default_factory=dict)  # fast="graphs": (rows, size, dtype) -> [GraphSet, ...]
    # fast="graphs": step key -> warm-up + capture seconds, less a compile
    capture_seconds: dict = field(default_factory=dict)
    captures: int = 0  # fast="graphs": buckets captured in this process (a recapture shows here)
    rent: dict = field(default_factory=dict)  # a bucket not compiled -> seconds its forwards took in a larger one


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_steps(model) -> ModelSteps:
    """The process-wide fast-path state of ``model`` (compiled steps, compile times)."""
    steps = _STEPS.get(model)
    if steps is None:
        steps = _STEPS[model] = ModelSteps()
    return steps


def batch_feature_step(layers: tuple[int, ...]):
    """:func:`batch_step` that also returns the fused features [B, W, F*H] of a feature draft's
    ``layers`` (the inputs of those decoder layers, transformers' ``hidden_states[i]``, concatenated
    in order: :meth:`~specdecpp.models.feature_draft.FeatureDraft.fuse`), as a third output: the
    verification's forward computes them anyway. Asked of the decoder as ``output_hidden_states``
    (a public argument), not by hooks: a compiled step's outputs are what dynamo keeps, and a hook's
    side effect would not run where the compiled graph is called directly."""
    layers = tuple(int(i) for i in layers)

    def step(decoder, head, cache_arg: str, cache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache.slots = slots
        out = decoder(input_ids=ids, position_ids=positions, attention_mask=mask, cache_position=slots,
                      use_cache=True, output_hidden_states=True, **{cache_arg: cache})
        hidden = out.last_hidden_state
        return head(hidden), hidden, torch.cat([out.hidden_states[i] for i in layers], dim=-1)

    return step


def feature_step(layers: tuple[int, ...]):
    """:func:`batch_feature_step` of one row (as :func:`static_step` is :func:`batch_step`'s):
    the logits [W, V], the final hidden state [W, H] and the fused features [W, F*H]."""
    batch = batch_feature_step(layers)

    def step(decoder, head, cache_arg: str, cache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, hidden, fused = batch(decoder, head, cache_arg, cache, ids[None], positions[None], slots, mask)
        return logits[0], hidden[0], fused[0]

    return step


_FEATURE_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def feature_model_steps(model, layers: tuple[int, ...]) -> ModelSteps:
    """As :func:`model_steps`, for ``model``'s feature steps of ``layers`` (:func:`feature_step`,
    :func:`batch_feature_step`): kept apart from its plain steps, whose compiled graphs return no features."""
    by_layers = _FEATURE_STEPS.get(model)
    if by_layers is None:
        by_layers = _FEATURE_STEPS[model] = {}
    return by_layers.setdefault(tuple(layers), ModelSteps())


def every_model_steps(model) -> list[ModelSteps]:
    """``model``'s plain steps (:func:`model_steps`) and its feature steps of every layer set
    (:func:`feature_model_steps`): what it compiled or captured in this process, for reports."""
    return [model_steps(model), *_FEATURE_STEPS.get(model, {}).values()]
