"""One vLLM draft step's candidates, stopped row by row by a stop policy (no vLLM import here).

vLLM's draft loop drafts one candidate for every request of the batch per pass, up to K passes.
:class:`StoppedDrafts` is told each pass's candidates (``add``), asks the policy which rows stop
after them (``stop_rows``, as the batch decoder of the library does), and at the end gives one
draft list per request, of that request's own length (``lists``), and the draft probabilities
those lists were sampled from (``probs``) for vLLM's rejection sampler. With load-aware lengths
(:class:`LoadAware`), the policy's stop is a cap and :class:`~specdecpp.vllm.load_aware.OnlineLengths`
cuts each request's length to the step's best rate; :class:`Outcomes` feeds the online acceptance
estimator the target's verdicts a step later.
"""

from __future__ import annotations

import torch

from ..stopping.policies import SpecDecPP, StopPolicy
from .acceptance import OnlineAcceptance, OnlineAcceptanceEstimator, max_log_odds
from .load_aware import OnlineLengths, StepCosts


class LoadAware:
    """Load-aware lengths for a proposer: the measured ``costs``, the draft-cost ``mode`` and where each
    pass's acceptance estimates come from (:meth:`estimates`): an OnlineAcceptance policy's, or a side
    :class:`OnlineAcceptanceEstimator` (vLLM's, calibrated while serving from the outcomes the proposer
    feeds it; its estimates are computed before the candidate is drawn, so a candidate may be dropped),
    and with a lag-free head, the head's own from the second pass on (it reads the candidate, so a
    drafted candidate is kept and only the next is decided). The first pass of a head's step takes the
    side estimator's, so that a request's first candidate can be dropped when verifying it does not pay
    (length 0: the step costs the target one token for that request), which the head, reading the
    candidate, cannot decide without bias."""

    def __init__(self, costs: StepCosts, policy: StopPolicy, max_len: int, mode: str = "dense") -> None:
        self.costs, self.mode = costs, mode
        self.head = isinstance(policy, SpecDecPP) and policy.head.lag == 0
        if isinstance(policy, OnlineAcceptance):
            self.estimator = policy.estimator
        else:
            self.estimator = OnlineAcceptanceEstimator(max_len)

    def estimates(self, policy: StopPolicy, k: int, logits, hidden, tokens, temperature: float,
                  record) -> tuple[torch.Tensor, bool]:
        """[B] this pass's estimates and whether they leave the candidates droppable; ``record(features,
        predictions)`` keeps what the estimator will be fed once the target has verified."""
        if self.head and k > 1:
            if policy.last_accept is not None and policy.last_accept[0] == k:  # stop_rows scored this pass
                return policy.last_accept[1], False
            score = policy.head.score(hidden if policy.needs_hidden else None, logits, tokens, None)
            return torch.sigmoid(score).double(), False
        if isinstance(policy, OnlineAcceptance):
            return policy.last_accept, True
        features = max_log_odds(logits, temperature)
        accept = self.estimator.predict(features, k)
        record(features, accept)
        return accept, True


class StoppedDrafts:
    """The candidates of one propose call under ``policy``, at most ``max_len`` per request; with
    ``load_aware``, each request's length is also cut to what maximises the step's expected committed
    tokens per second (:class:`~specdecpp.vllm.load_aware.OnlineLengths`), the policy's stop a cap.

    ``lengths[b]``: row b's candidates kept so far (final once ``drafting[b]`` is False)."""

    def __init__(self, policy: StopPolicy, max_len: int, load_aware: LoadAware | None = None,
                 temperature: float = 0.0) -> None:
        self.policy = policy
        self.max_len = max_len
        self.load_aware = load_aware
        self.temperature = temperature
        self.tokens: list[torch.Tensor] = []  # per pass: [B]
        self.probs: list[torch.Tensor] = []  # per pass: [B, V] (probabilistic draft sampling only)
        self.lengths: torch.Tensor | None = None  # [B] int64
        self.drafting: torch.Tensor | None = None  # [B] bool
        self.online: OnlineLengths | None = None
        self.features: list[torch.Tensor] = []  # per pass: [B], the side estimator's (load-aware)
        self.predictions: list[torch.Tensor] = []
        policy.begin_round(None)

    @property
    def done(self) -> bool:
        """Every row has stopped (or nothing is to be drafted)."""
        return self.max_len == 0 or (self.drafting is not None and not bool(self.drafting.any()))

    def _record(self, features: torch.Tensor, predictions: torch.Tensor) -> None:
        self.features.append(features)
        self.predictions.append(predictions)

    @torch.no_grad()
    def add(self, logits: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor,
            probs: torch.Tensor | None) -> bool:
        """Candidates ``tokens`` [B] of this pass, drafted from the draft's raw ``logits`` [B, V] at the
        states ``hidden`` [B, H] (those that produced the logits), ``probs`` [B, V] the distribution they
        were sampled from (None: greedy). Returns whether every row has now stopped."""
        k = len(self.tokens) + 1
        batch = tokens.shape[0]
        if self.lengths is None:
            self.lengths = torch.zeros(batch, dtype=torch.long, device=tokens.device)
            self.drafting = torch.ones(batch, dtype=torch.bool, device=tokens.device)
        self.tokens.append(tokens)
        if probs is not None:
            self.probs.append(probs)
        active = self.drafting
        policy = self.policy
        plan = self.load_aware
        if plan is not None and plan.head and k == 1:
            return self._first_pass_of_a_head(logits, hidden, tokens, active)

        def stop_rows() -> torch.Tensor:
            # the online estimator's policy is asked at the last pass too: its estimates are recorded to be fed
            if k < self.max_len or isinstance(policy, OnlineAcceptance):
                stop = policy.stop_rows(k, logits, hidden if policy.needs_hidden else None, tokens, active).to(
                    active.device) & active
            return active if k >= self.max_len else stop

        stop = stop_rows()
        if plan is None:
            self.lengths[stop] = k
            self.drafting = active & ~stop
            return self.done
        accept, droppable = plan.estimates(self.policy, k, logits, hidden, tokens, self.temperature, self._record)
        if self.online is None:
            self.online = OnlineLengths(plan.costs, batch, self.max_len, plan.mode)
        caps = torch.where(stop, torch.tensor(k, device=stop.device), torch.tensor(self.max_len, device=stop.device))
        keep, more = self.online.step(accept.detach().cpu(), caps.cpu(), droppable=droppable)
        return self._apply(keep, more, active, k)

    def _first_pass_of_a_head(self, logits, hidden, tokens, active) -> bool:
        """A lag-free head's first pass under load-aware lengths: which first candidates are kept is planned
        from the side estimator's estimates (made before the candidates were drawn) alone; the head, which
        reads them, is asked only if a kept row could draft on, and its stop then ends rows after their
        candidate (it must not weigh in on dropping it: that would bias the output)."""
        plan, policy = self.load_aware, self.policy
        accept, droppable = plan.estimates(policy, 1, logits, hidden, tokens, self.temperature, self._record)
        self.online = OnlineLengths(plan.costs, tokens.shape[0], self.max_len, plan.mode)
        keep, more = self.online.step(accept.detach().cpu(), None, droppable=True)
        if bool(more.any()):
            stop = policy.stop_rows(1, logits, hidden if policy.needs_hidden else None, tokens, active)
            more = self.online.end(stop.cpu() | (self.max_len <= 1))
        return self._apply(keep, more, active, 1)

    def _apply(self, keep, more, active, k: int) -> bool:
        keep, more = keep.to(active.device), more.to(active.device)
        self.lengths[keep & active] = k
        self.drafting = active & more
        return self.done

    def lists(self, batch_size: int) -> list[list[int]]:
        """One draft list per request, row b's first ``lengths[b]`` candidates."""
        if not self.tokens:
            return [[] for _ in range(batch_size)]
        drafted = torch.stack(self.tokens, dim=1)[:batch_size].tolist()
        lengths = self.lengths.tolist()
        return [row[:n] for row, n in zip(drafted, lengths, strict=True)]

    def stacked_probs(self) -> torch.Tensor | None:
        """[B, passes, V]: the draft distributions, None where the draft sampled greedily."""
        return torch.stack(self.probs, dim=1).contiguous() if self.probs else None

    def estimator_inputs(self) -> tuple[OnlineAcceptanceEstimator, torch.Tensor, torch.Tensor] | None:
        """The estimator to feed once the target has verified this step, with the [B, passes] features
        and predictions it made (None where no online estimator drafted)."""
        if isinstance(self.policy, OnlineAcceptance) and self.policy.round_features() is not None:
            return (self.policy.estimator, *self.policy.round_features())
        if self.load_aware is not None and self.load_aware.estimator is not None and self.features:
            return self.load_aware.estimator, torch.stack(self.features, 1), torch.stack(self.predictions, 1)
        return None


class Outcomes:
    """Feeds an online estimator its verification outcomes across steps: :meth:`drafted` records each
    request's features and list length at the end of a propose call, :meth:`verified` (the next step,
    with the number of tokens the target kept for each request: accepted + 1) labels them."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[OnlineAcceptanceEstimator, torch.Tensor, torch.Tensor, int]] = {}

    def drafted(self, req_ids, drafts: StoppedDrafts) -> None:
        inputs = drafts.estimator_inputs()
        self.pending = {}
        if inputs is None or drafts.lengths is None:
            return
        estimator, features, predictions = inputs
        features, predictions, lengths = features.cpu(), predictions.cpu(), drafts.lengths.tolist()
        for row, req_id in enumerate(req_ids[: len(lengths)]):
            drafted = min(lengths[row], features.shape[1])  # a head's side estimator scored the first pass only
            if drafted > 0:
                self.pending[req_id] = (estimator, features[row], predictions[row], drafted)

    def verified(self, req_ids, kept_counts) -> int:
        """Feed the outcomes of the requests that drafted last step; returns how many were fed."""
        if not self.pending:
            return 0
        by_estimator: dict[int, list] = {}
        for req_id, kept in zip(req_ids, kept_counts, strict=False):
            entry = self.pending.get(req_id)
            if entry is None or kept < 1:
                continue
            estimator, features, predictions, drafted = entry
            by_estimator.setdefault(id(estimator), [estimator, [], [], [], []])
            group = by_estimator[id(estimator)]
            group[1].append(features)
            group[2].append(predictions)
            group[3].append(drafted)
            group[4].append(min(int(kept) - 1, drafted))
        self.pending = {}
        fed = 0
        for estimator, features, predictions, drafted, accepted in by_estimator.values():
            estimator.observe(torch.stack(features), drafted, accepted, torch.stack(predictions))
            fed += len(drafted)
        return fed
