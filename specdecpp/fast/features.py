"""A feature pair's target on the fast path (docs/feature_draft.md, "On the fast path"): a
:class:`~specdecpp.fast.runners.StaticRunner` whose step also returns the fused features of the
feature draft's layers (:func:`~specdecpp.fast.step.feature_step`), written into the pair's
:class:`~specdecpp.models.feature_runner.FeatureStore` after every forward, as the eager
:class:`~specdecpp.models.feature_runner.FeatureTargetRunner` writes them. The draft keeps its own
runner (:class:`~specdecpp.models.feature_runner.FeatureDraftRunner`, eager, its own cache): it is not
a transformers model with a decoder and an output layer, and its one layer is a few percent of a
target forward. CUDA graphs do not take a feature pair (the decoders refuse it)."""

from __future__ import annotations

import functools
import weakref

import torch

from ..models.feature_runner import FeatureStore, FollowsFeatureStore, KeepsRowFeatures, RowStores, feature_runners
from .batch_runner import StaticBatchRunner
from .buckets import COMPILING_BACKENDS, GRAPH_BACKENDS
from .calls import CallRunners
from .runners import StaticRunner
from .step import batch_feature_step, feature_model_steps, feature_step


class StaticFeatureTargetRunner(FollowsFeatureStore, StaticRunner):
    """A feature pair's target over the static cache: :class:`StaticRunner` (``fast`` "static" or
    "compile") whose every forward also writes the fused features of ``layers`` at the positions it
    fed into ``store``; a rollback or a compaction follows the cache. Its compiled steps are kept
    apart from the model's plain ones (:func:`~specdecpp.fast.step.feature_model_steps`)."""

    def __init__(self, model, vocab: int, want_hidden: bool, layers, store: FeatureStore, **static) -> None:
        refuse_graphs(static.get("fast"))
        super().__init__(model, vocab, want_hidden, **static)
        self.store = store
        take_feature_steps(self, layers, feature_step, "feature_step")

    def feed(self, ids: torch.Tensor, n_logits: int = 1, position_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None):
        start = self.length
        out = super().feed(ids, n_logits, position_ids, attention_mask)
        self.store.write(start, self.extras[0])
        return out


class StaticBatchFeatureTargetRunner(KeepsRowFeatures, StaticBatchRunner):
    """A feature pair's target in a batch over the static cache of per-row lengths:
    :class:`StaticBatchRunner` (``fast`` "static" or "compile") whose every forward, the joining rows'
    prefill included, also gives the fused features of ``layers`` (:func:`~specdecpp.fast.step.batch_feature_step`),
    written into each row's store of ``stores`` (:class:`~specdecpp.models.feature_runner.RowStores`,
    shared with the eager :class:`~specdecpp.decoders.batch_features.BatchFeatureDraftRunner`), as the
    eager :class:`~specdecpp.decoders.batch_features.BatchFeatureTargetRunner` writes them."""

    def __init__(self, model, vocab: int, want_hidden: bool, layers, stores: RowStores, **static) -> None:
        refuse_graphs(static.get("fast"))
        super().__init__(model, vocab, want_hidden, **static)
        self.stores = stores
        take_feature_steps(self, layers, batch_feature_step, "batch_feature_step")

    def _fused_of(self) -> torch.Tensor:
        return self.extras[0]


def take_feature_steps(runner, layers, make_step, name: str) -> None:
    """A static runner (one row or a batch) of a feature pair's target runs ``make_step(layers)``,
    which also returns the fused features, under ``name``; its compiled steps are kept apart from
    the model's plain ones (:func:`~specdecpp.fast.step.feature_model_steps`)."""
    runner.layers = tuple(int(i) for i in layers)
    if runner.fast in COMPILING_BACKENDS:
        prime_hidden_states(runner.model)
    runner.steps = feature_model_steps(runner.model, runner.layers)
    runner.step_fn, runner.step_name = make_step(runner.layers), name


def refuse_graphs(fast: str | None) -> None:
    if fast in GRAPH_BACKENDS:
        raise ValueError(f"a feature pair's target runs on fast='static' or 'compile', not {fast!r}: "
                         "CUDA graphs do not hand the draft the target's features")


_PRIMED: weakref.WeakSet = weakref.WeakSet()


def prime_hidden_states(model) -> None:
    """One eager call of ``model``'s decoder with ``output_hidden_states=True`` (one token, no
    cache), once per model, before a feature step compiles: transformers 5 installs the hooks that
    collect ``hidden_states`` on the first call that asks for them, under a threading lock that
    dynamo cannot trace ("Unsupported context manager"); installed, they are traced like the rest
    (tests/decoders/test_feature_exactness.py compiles a fresh model's feature step first)."""
    if model in _PRIMED:
        return
    device = next(model.parameters()).device
    with torch.no_grad():
        model.get_decoder()(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False,
                            output_hidden_states=True)
    _PRIMED.add(model)


def fast_feature_runners(draft, target, runners: CallRunners, tokens: int, buckets: tuple[int, ...]):
    """A feature pair's runner factories for a call of ``tokens`` tokens and the target's ``buckets``
    (:func:`~specdecpp.models.feature_runner.feature_runners`): the eager target runner under
    ``fast=None``, else :class:`StaticFeatureTargetRunner` sized as ``runners`` sizes the call."""
    if runners.fast is None:
        return feature_runners(draft, target)
    return feature_runners(draft, target, functools.partial(StaticFeatureTargetRunner, fast=runners.fast,
                                                            **runners.sizing(tokens, buckets)))


def warm_up_features(draft, target, runners: CallRunners, tokens: int, buckets: tuple[int, ...],
                     rows: int | None = None, progress: bool = False) -> float:
    """Compile every target bucket of a feature pair's call of ``tokens`` tokens (with ``rows``:
    of its batch calls of at most that many rows at once), its feature steps (kept for the process),
    as :meth:`CallRunners.warm_up` does for a plain pair; the seconds it took (0 unless
    ``fast="compile"``)."""
    static = (functools.partial(StaticFeatureTargetRunner, layers=draft.aux_layers, store=FeatureStore())
              if rows is None else
              functools.partial(StaticBatchFeatureTargetRunner, layers=draft.aux_layers, stores=RowStores()))
    return runners.warm_up(tokens, [(target, buckets)], rows, progress, static=static)
