"""Load-aware lengths inside vLLM (specdecpp.vllm.load_aware through the proposer): greedy output still
equals vLLM target-only's, a flat step-cost curve leaves the policy's own lengths, a steep one
shrinks them (to 0 for some requests), the step costs can be measured at the proposer's start-up,
and the online acceptance estimator is fed the target's verdicts (tiny random pair)."""

from __future__ import annotations

import pytest

from tests.helpers.vllm import require_vllm

require_vllm()

from specdecpp import FixedK  # noqa: E402
from specdecpp.vllm import internals, speculative_config  # noqa: E402
from specdecpp.vllm.acceptance import OnlineAcceptance, OnlineAcceptanceEstimator  # noqa: E402
from specdecpp.vllm.load_aware import StepCosts  # noqa: E402
from tests.helpers.vllm import VLLM_WARNINGS, close, recorded_lengths, save_pair, start  # noqa: E402
from tests.vllm.test_vllm_greedy import greedy_tokens  # noqa: E402

pytestmark = VLLM_WARNINGS
FLAT = StepCosts((1,), (0.01,), (1,), (0.0,))
# flat to 8 tokens, then 1 ms a token against a 10 ms step: with 6 requests drafting rarely pays
STEEP = StepCosts((1, 8, 64), (0.01, 0.01, 0.066), (1, 16), (0.001, 0.001))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("vllm_load_aware_pair"))


@pytest.fixture(scope="module")
def reference(pair):
    llm = start(pair[1])
    try:
        return greedy_tokens(llm)
    finally:
        close(llm)


def run(pair, spec):
    llm = start(pair[1], spec)
    try:
        with recorded_lengths() as lengths:
            tokens = greedy_tokens(llm)
    finally:
        close(llm)
    assert lengths, "the proposer of specdecpp.vllm did not run"
    return tokens, lengths


def test_load_aware_lengths_keep_target_only_tokens_and_shrink_under_a_steep_cost(pair, reference, tmp_path):
    flat_tokens, flat = run(pair, speculative_config(pair[0], stop_policy=FixedK(3), load_aware=FLAT,
                                                     cache_dir=tmp_path))
    steep_tokens, steep = run(pair, speculative_config(pair[0], stop_policy=FixedK(3), load_aware=STEEP,
                                                       cache_dir=tmp_path))
    assert flat_tokens == reference and steep_tokens == reference
    assert all(n == 3 for step in flat for n in step)  # flat: the policy's own stop
    steep_lengths = [n for step in steep for n in step]
    assert all(0 <= n <= 3 for n in steep_lengths) and 0 in steep_lengths
    assert sum(steep_lengths) / len(steep_lengths) < 2.0, steep


def test_a_lag_free_heads_load_aware_lengths_drop_first_candidates_under_a_steep_cost(pair, reference, tmp_path):
    """A lag-free head under load-aware lengths: a flat cost keeps at least one candidate a request (the
    head's own stop), a steep one drops first candidates (length 0, decided before they are drawn);
    greedy output equals target-only's either way."""
    from tests.vllm.test_vllm_greedy import varied_head

    head = {"head": varied_head("next", 2), "threshold": 0.5, "max_candidates": 3}
    flat_tokens, flat = run(pair, speculative_config(pair[0], load_aware=FLAT, cache_dir=tmp_path, **head))
    steep_tokens, steep = run(pair, speculative_config(pair[0], load_aware=STEEP, cache_dir=tmp_path, **head))
    assert flat_tokens == reference and steep_tokens == reference
    flat_lengths, steep_lengths = [n for step in flat for n in step], [n for step in steep for n in step]
    assert all(1 <= n <= 3 for n in flat_lengths)
    assert 0 in steep_lengths and sum(steep_lengths) < sum(flat_lengths), (flat, steep)


def test_the_step_costs_are_measured_at_start_up_and_the_estimator_is_fed(pair, reference, tmp_path, monkeypatch):
    measured, fed = [], []
    original_measure, original_observe = internals.measure_step_costs, OnlineAcceptanceEstimator.observe

    def measure(*args, **kwargs):
        measured.append(original_measure(*args, **kwargs))
        return measured[-1]

    def observe(self, features, num_drafted, num_accepted, predictions=None):
        fed.append((list(num_drafted), list(num_accepted)))
        return original_observe(self, features, num_drafted, num_accepted, predictions)

    monkeypatch.setattr(internals, "measure_step_costs", measure)
    monkeypatch.setattr(OnlineAcceptanceEstimator, "observe", observe)
    # the target drafts for itself: every verified candidate is accepted, and the estimator learns so
    spec = speculative_config(pair[1], stop_policy=OnlineAcceptance(0.7, max_candidates=3, refit_interval=5),
                              load_aware=True, cache_dir=tmp_path)
    tokens, lengths = run(pair, spec)
    assert tokens == reference
    assert len(measured) == 1 and len(measured[0].target_tokens) >= 2 and measured[0].target_seconds[-1] > 0
    assert len(fed) >= 5, fed
    drafted = [d for step, _ in fed for d in step]
    accepted = [a for _, step in fed for a in step]
    assert all(0 < d <= 3 for d in drafted) and sum(accepted) > 0.9 * sum(drafted)  # (less what max_tokens cut)
