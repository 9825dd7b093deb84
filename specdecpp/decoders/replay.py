"""A call's captured rounds (docs/engine.md, "Captured rounds"): which of its rounds are captured
(:func:`round_plan`, :func:`replayable`), the graphs captured once per process and kept on the target's
graph set (:func:`round_graph`, :func:`step_graphs`; the graphs themselves: specdecpp/decoders/captured.py),
and :class:`CapturedRounds`, what a call's loop asks to replay a round: the replay, the commit and the
caches' lengths and statistics after it."""

from __future__ import annotations

import logging

import torch

from ..core.sampling import SamplingConfig
from ..fast.buckets import GRAPH_BACKENDS, fit_buckets
from ..fast.runners import StaticRunner
from ..fast.step import model_steps
from ..stopping.policies import FixedK, StopPolicy, TargetOnly
from .captured import RoundGraph, StepGraphs
from .rounds import CallHooks, RunStats, TokenBuffer

log = logging.getLogger(__name__)


class CapturedRounds:
    """The captured rounds of one call of a :class:`~specdecpp.decoders.chain.SpeculativeDecoder`
    (``decoder``: its policy, backend, ``capture_rounds``, cascade, profile, sampling and vocabulary),
    over the call's draft ``drafter`` and target runner ``target``. Planned by :func:`round_plan` (None:
    no round of the call is replayed), captured on the first round that can replay (:meth:`replay`).
    A capture that fails is said once in a warning; the decoder's ``capture_rounds`` is then False, and
    this call and its later ones decode round by round (per-forward graphs)."""

    def __init__(self, decoder, drafter, target, hooks: CallHooks | None, target_buckets: tuple[int, ...],
                 max_new_tokens: int) -> None:
        self.decoder, self.drafter, self.target = decoder, drafter, target
        self.plan = round_plan(decoder.policy, decoder.fast, decoder.capture_rounds, decoder.cascade,
                               decoder.profile, hooks, target_buckets, max_new_tokens)
        self.graphs = None  # a RoundGraph or StepGraphs, bound to the call's tokens, on first use

    def replay(self, seq: TokenBuffer, generator: torch.Generator | None, stats: RunStats) -> bool:
        """Replay ``seq``'s next round where it can be (:func:`replayable`), commit it, set both caches'
        lengths to what is kept and count it in ``stats`` (its draft and target times 0: not apart in
        one graph); True where it did, False where the caller runs the round itself."""
        if self.plan is None:
            return False
        how, k_max = self.plan
        draft, target = self.drafter.runner, self.target
        if not replayable(seq, k_max if how == "round" else None, draft, target):
            return False
        self.graphs = self.graphs or self._capture(seq)
        if self.graphs is None:  # the capture failed: round by round from here on
            self.plan = None
            return False
        n = seq.n  # committed: seq.tokens[:n]; tokens[n - 1] is in neither cache yet
        k, n_acc, token, drafts = self.graphs.run(seq, min(k_max, seq.room - 1), generator)
        kept = seq.commit(n_acc, token, drafts, written=True)
        target.cache.length = seq.n - 1  # the replay fed up to n + K - 1; the host sets what is kept
        if k:
            draft.cache.length = min(n + k - 1, seq.n - 1)
        stats.add_round(k, k, n_acc, k + 1 - kept, 0.0, 0.0)
        stats.replayed_rounds += 1
        return True

    def _capture(self, seq: TokenBuffer) -> RoundGraph | StepGraphs | None:
        """The call's graphs: a whole round's (``("round", K)``) or an adaptive policy's candidates'
        and verdicts' (``("steps", K)``), bound to ``seq``; None where the capture failed, which is
        said once, and the decoder then decodes round by round (``capture_rounds`` False)."""
        decoder, drafter, (how, k) = self.decoder, self.drafter, self.plan
        try:
            fused = decoder.capture_rounds == "fused"
            if how == "round":
                return round_graph(drafter.runner, self.target, k, decoder.sampling, decoder.vocab, seq, fused)
            return step_graphs(drafter.runner, self.target, decoder.policy, k, decoder.sampling, decoder.vocab,
                               drafter.eos if drafter.stop_at_eos else set(), seq, fused)
        except CaptureFailed as exc:
            # the text, not the exception: a kept log record would keep its traceback's frames, and the runners in them
            log.warning("%s; decoding round by round (capture_rounds=False)", str(exc))
            decoder.capture_rounds = False
            return None


def round_plan(policy, fast: str | None, capture: bool, cascade, profile: bool, hooks: CallHooks | None,
               target_buckets: tuple[int, ...], max_new_tokens: int) -> tuple[str, int] | None:
    """How a call's rounds are captured (docs/engine.md, "Captured rounds"): ``("round", K)`` for fixed K and
    target-only (a whole round one graph), ``("steps", K)`` for a policy that decides on the device
    (``stop_rows``: SVIP, the heads) with at most K candidates a round (its ``max_candidates``, or
    fewer where the call has room for fewer), None where they are not captured (also where K + 1
    tokens are wider than the widest bucket)."""
    if not capture or fast not in GRAPH_BACKENDS or cascade is not None or profile:
        return None
    if hooks is not None and (hooks.draft_logits is not None or hooks.target_logits is not None):
        return None
    if isinstance(policy, (FixedK, TargetOnly)):
        k, how = policy.max_candidates, "round"
    elif type(policy).stop_rows is StopPolicy.stop_rows:  # it decides one row at a time, on the host
        return None
    else:
        k, how = min(policy.max_candidates, max_new_tokens - 1), "steps"
        if k < 1:
            return None
    return (how, k) if k + 1 <= target_buckets[-1] else None


def replayable(seq: TokenBuffer, k: int, draft, target) -> bool:
    """Whether ``seq``'s next round can be a replay: K candidates fit (an adaptive round: one, ``k``
    None), the target holds ``tokens[:n - 1]`` and the draft at least ``tokens[:n - 2]`` (not so
    before the prefill)."""
    n = seq.n
    fits = seq.room - 1 >= (1 if k is None else k)
    return fits and target.length == n - 1 and (k == 0 or (n >= 2 and draft.length >= n - 2))


class CaptureFailed(RuntimeError):
    """A round's capture failed; the decoder goes on round by round (per-forward graphs)."""


def _kept(draft: StaticRunner, target: StaticRunner, key: tuple, label: tuple, build, seq: TokenBuffer):
    """The captured graphs under ``key`` on the target's graph set, bound to ``seq``; built by
    ``build()`` and captured on ``seq``'s state on first use, the capture's seconds (less any compile
    its warm-ups ran) kept in ``model_steps(target).capture_seconds[label]``."""
    rounds = target.graph_set.rounds
    graphs = rounds.get(key)
    if graphs is not None:
        graphs.bind(seq)
        return graphs
    graphs = build()
    graphs.bind(seq)
    pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
    steps, models = model_steps(target.model), (target.model, draft.model)

    def compiled() -> float:
        return sum(sum(model_steps(m).compile_seconds.values()) for m in models)

    before = compiled()
    try:
        seconds = graphs.capture(seq, pool)
    except RuntimeError as exc:
        raise CaptureFailed(f"capturing {type(graphs).__name__} {label} failed ({exc})") from exc
    steps.capture_seconds[label] = seconds - (compiled() - before)
    steps.captures += 1
    rounds[key] = graphs
    return graphs


def round_graph(draft: StaticRunner, target: StaticRunner, k: int, sampling: SamplingConfig, vocab: int,
                seq: TokenBuffer, fused: bool = False) -> RoundGraph:
    """The round graph of these runners' buffers, K, the target's bucket for K + 1 tokens and
    ``sampling`` (``fused``: its work between forwards compiled): kept on the target's graph set,
    captured on its first use (on ``seq``'s state)."""
    width = fit_buckets(k + 1, target.buckets)[-1]
    key = (id(draft.graph_set), k, width, sampling.temperature, sampling.top_k, sampling.top_p, vocab, fused)
    return _kept(draft, target, key, ("round", k, width, target.cache.size),
                 lambda: RoundGraph(draft, target, k, sampling, vocab, width, fused), seq)


def step_graphs(draft: StaticRunner, target: StaticRunner, policy: StopPolicy, k: int, sampling: SamplingConfig,
                vocab: int, eos: set[int], seq: TokenBuffer, fused: bool = False) -> StepGraphs:
    """The step graphs of these runners' buffers, ``policy`` (this object: its round state lives in
    them), at most ``k`` candidates and ``sampling``: kept on the target's graph set, captured on first
    use (on ``seq``'s state)."""
    key = (id(draft.graph_set), "steps", id(policy), k, sampling.temperature, sampling.top_k, sampling.top_p, vocab,
           tuple(sorted(eos)), fused)
    width = fit_buckets(k + 1, target.buckets)[-1]
    return _kept(draft, target, key, ("steps", k, width, target.cache.size),
                 lambda: StepGraphs(draft, target, policy, k, sampling, vocab, eos, fused), seq)
