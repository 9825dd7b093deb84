"""specdecpp.vllm.drafts.StoppedDrafts with load-aware lengths and a lag-free head, outside vLLM (pure
torch): the first candidate of a request can be dropped when verifying it does not pay (the side
estimator's estimate, made before the candidate is drawn), the decision to drop it does not depend on
the candidate drawn (the head, which reads it, may only end the row after it), and later candidates are
kept once drafted."""

from __future__ import annotations

import torch

from specdecpp import NextTokenHead, SpecDecPP
from specdecpp.vllm.drafts import LoadAware, Outcomes, StoppedDrafts
from specdecpp.vllm.load_aware import StepCosts

HIDDEN, VOCAB, ROWS, K = 16, 32, 6, 3
FLAT = StepCosts((1,), (1.0,), (1,), (0.001,))  # verifying more costs nothing: the policy's own stop
# flat to 4 tokens, then 1 s a token against a 1 s step: with 6 requests a verified candidate rarely pays
STEEP = StepCosts((1, 4, 64), (1.0, 1.0, 61.0), (1, 16), (0.01, 0.01))


class ConstantHead(NextTokenHead):
    """A lag-free head that answers ``logit`` for every candidate (the stop rule reads it)."""

    def __init__(self, logit: float):
        super().__init__(HIDDEN, depth=1)
        self.logit = logit

    def score(self, hidden, logits, token, positions=None):
        return torch.full(token.shape, self.logit)


class TokenHead(ConstantHead):
    """Stops (a low logit) exactly where the candidate is even: the head reads the token drawn."""

    def score(self, hidden, logits, token, positions=None):
        return torch.where(token % 2 == 0, torch.tensor(-4.0), torch.tensor(4.0))


def draft_step(policy, costs, tokens_by_pass, logits_by_pass):
    drafts = StoppedDrafts(policy, K, LoadAware(costs, policy, K), temperature=1.0)
    for tokens, logits in zip(tokens_by_pass, logits_by_pass, strict=True):
        if drafts.add(logits, torch.zeros(ROWS, HIDDEN), tokens, torch.softmax(logits, -1)):
            break
    return drafts


def passes(seed: int, confident: bool = False):
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(ROWS, VOCAB, generator=g) * (8.0 if confident else 0.5) for _ in range(K)]
    tokens = [torch.randint(0, VOCAB, (ROWS,), generator=g) for _ in range(K)]
    return tokens, logits


def test_at_a_flat_cost_a_heads_rows_draft_to_its_own_stop():
    tokens, logits = passes(0)
    drafts = draft_step(SpecDecPP(ConstantHead(4.0), threshold=0.5, max_candidates=K), FLAT, tokens, logits)
    assert drafts.lengths.tolist() == [K] * ROWS  # sigmoid(4) = 0.98 a candidate: no stop within K


def test_under_a_steep_cost_a_heads_first_candidates_are_dropped():
    tokens, logits = passes(1)  # flat draft distributions: the side estimator expects little acceptance
    drafts = draft_step(SpecDecPP(ConstantHead(4.0), threshold=0.5, max_candidates=K), STEEP, tokens, logits)
    assert drafts.lengths.tolist() == [0] * ROWS and drafts.done
    assert drafts.lists(ROWS) == [[] for _ in range(ROWS)]
    assert len(drafts.tokens) == 1  # the loop ended after the first pass


def test_dropping_a_first_candidate_does_not_depend_on_the_candidate_drawn():
    """Two steps that differ only in the first pass's candidates: the head (which reads them) stops other
    rows, but which first candidates are kept is the same (it is decided from q_1 and the costs)."""
    policy = SpecDecPP(TokenHead(0.0), threshold=0.5, max_candidates=K)
    middling = StepCosts((1, 4, 64), (1.0, 1.0, 5.0), (1, 16), (0.01, 0.01))
    tokens, logits = passes(2, confident=True)
    logits[0][:3] *= 0.02  # three rows with flat q_1 (little expected acceptance), three confident ones
    even, odd = tokens[0] - tokens[0] % 2, tokens[0] - tokens[0] % 2 + 1
    a = draft_step(policy, middling, [even] + tokens[1:], logits)
    b = draft_step(policy, middling, [odd] + tokens[1:], logits)
    kept_a, kept_b = a.lengths >= 1, b.lengths >= 1
    assert torch.equal(kept_a, kept_b) and kept_a.any() and not kept_a.all()
    assert (a.lengths[kept_a] == 1).all()  # even candidates: the head stops each kept row after it
    assert (b.lengths[kept_b] > 1).any()  # odd ones: rows go on


def test_a_heads_later_candidates_are_kept_once_drafted():
    tokens, logits = passes(3, confident=True)
    drafts = draft_step(SpecDecPP(ConstantHead(4.0), threshold=0.5, max_candidates=K), FLAT, tokens, logits)
    assert drafts.lengths.tolist() == [len(row) for row in drafts.lists(ROWS)] == [K] * ROWS


def test_the_side_estimator_is_fed_the_first_candidates_outcome_only():
    tokens, logits = passes(4, confident=True)
    drafts = draft_step(SpecDecPP(ConstantHead(4.0), threshold=0.5, max_candidates=K), FLAT, tokens, logits)
    outcomes = Outcomes()
    outcomes.drafted([f"r{j}" for j in range(ROWS)], drafts)
    assert {entry[3] for entry in outcomes.pending.values()} == {1}  # drafted 3, scored by the estimator: 1
    seen = []
    estimator = drafts.load_aware.estimator
    original = estimator.observe
    estimator.observe = lambda f, d, a, p=None: (seen.append((list(d), list(a))), original(f, d, a, p))
    assert outcomes.verified([f"r{j}" for j in range(ROWS)], [4, 1, 2, 3, 1, 4]) == ROWS
    assert seen == [([1] * ROWS, [1, 0, 1, 1, 0, 1])]
