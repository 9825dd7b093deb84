"""vLLM's online acceptance estimator (specdecpp.vllm.acceptance): its feature, its cold start, its
labels, its calibration to a known acceptance curve, and the stop policy on it. Pure torch: runs
without vLLM."""

from __future__ import annotations

import math

import pytest
import torch

from specdecpp.vllm.acceptance import (
    INIT_BIAS,
    INIT_SLOPE,
    MAX_LOG_ODDS,
    OnlineAcceptance,
    OnlineAcceptanceEstimator,
    max_log_odds,
)


def test_the_feature_is_the_log_odds_of_the_most_likely_token():
    torch.manual_seed(0)
    logits = torch.randn(5, 11) * 3
    for temperature in (1.0, 0.7):
        q = torch.softmax(logits.double() / temperature, -1).max(-1).values
        assert torch.allclose(max_log_odds(logits, temperature), torch.log(q / (1 - q)))
    q = torch.softmax(logits.double(), -1).max(-1).values
    assert torch.allclose(max_log_odds(logits, 0.0), torch.log(q / (1 - q)))  # greedy: the raw distribution
    sure = torch.tensor([[0.0, 500.0, 0.0]])
    assert max_log_odds(sure, 1.0).item() == MAX_LOG_ODDS
    assert max_log_odds(torch.tensor([[2.0, 2.0, -100.0]]), 1.0).item() == pytest.approx(0.0, abs=1e-12)  # a tie


def test_the_cold_start_is_vllms():
    est = OnlineAcceptanceEstimator(3)
    f = torch.tensor([-2.0, 0.0, 3.0])
    assert torch.allclose(est.predict(f, 2), torch.sigmoid(INIT_SLOPE * f.double() + INIT_BIAS))
    assert torch.equal(est.predict(f, 9), est.predict(f, 3))  # past the last position: its intercept


def test_accepted_candidates_and_the_first_rejected_are_labelled_later_ones_are_not():
    est = OnlineAcceptanceEstimator(3, refit_interval=1, damping=0.0)
    est.observe(torch.zeros(4, 3), num_drafted=[2] * 4, num_accepted=[2] * 4)  # all of 2 accepted
    assert est.intercepts[0] > INIT_BIAS and est.intercepts[1] > INIT_BIAS and est.intercepts[2] == INIT_BIAS
    est = OnlineAcceptanceEstimator(3, refit_interval=1, damping=0.0)
    est.observe(torch.zeros(4, 3), num_drafted=[3] * 4, num_accepted=[0] * 4)  # the first rejected
    assert est.intercepts[0] < INIT_BIAS and est.intercepts[1:].tolist() == [INIT_BIAS] * 2
    est = OnlineAcceptanceEstimator(3, refit_interval=2)
    est.observe(torch.zeros(4, 3), num_drafted=[3] * 4, num_accepted=[0] * 4)
    assert est.refits == 0 and est.intercepts[0] == INIT_BIAS  # refitted every refit_interval steps
    est.observe(torch.zeros(4, 3), num_drafted=[3] * 4, num_accepted=[0] * 4)
    assert est.refits == 1 and est.intercepts[0] < INIT_BIAS


def test_it_calibrates_to_the_acceptance_it_observes():
    """Outcomes drawn from sigmoid(1.5 f + b_k): the fit finds the slope and the intercepts (vLLM sums
    many steps per refit: a Newton step on one step's 64 requests alone is noisy)."""
    gen = torch.Generator().manual_seed(0)
    slope, bias = 1.5, torch.tensor([0.8, -0.2, -1.0], dtype=torch.float64)
    est = OnlineAcceptanceEstimator(3, refit_interval=50)
    for _ in range(400):
        f = torch.randn(64, 3, generator=gen, dtype=torch.float64) * 2
        accepted = torch.rand(64, 3, generator=gen, dtype=torch.float64) < torch.sigmoid(slope * f + bias)
        num_accepted = accepted.long().cumprod(1).sum(1)  # up to the first rejection
        est.observe(f, torch.full((64,), 3), num_accepted)
    assert est.refits == 8 and est.slope == pytest.approx(slope, abs=0.15)
    assert torch.allclose(est.intercepts, bias, atol=0.2), est.intercepts


def test_bad_outcomes_are_refused():
    est = OnlineAcceptanceEstimator(2)
    with pytest.raises(ValueError, match="features must be"):
        est.observe(torch.zeros(3), [1, 1, 1], [0, 0, 0])
    with pytest.raises(ValueError, match="need 2 entries"):
        est.observe(torch.zeros(2, 2), [1], [0])
    with pytest.raises(ValueError, match="0 <= num_accepted <= num_drafted"):
        est.observe(torch.zeros(2, 2), [1, 1], [2, 0])
    with pytest.raises(ValueError, match="positions must be an integer >= 1"):
        OnlineAcceptanceEstimator(0)


def test_the_policy_stops_once_a_rejection_is_likely():
    policy = OnlineAcceptance(threshold=0.5, max_candidates=4)
    policy.bind(None, 1.0)
    confident = torch.tensor([[8.0, 0.0, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0]])  # log-odds ~6.9 and ~-0.6
    policy.begin_round()
    stops = [policy.stop_rows(k, confident, None, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))
             for k in (1, 2, 3)]
    a = policy.estimator.predict(max_log_odds(confident, 1.0), 1)
    expected = [(1 - a ** k > 0.5) for k in (1, 2, 3)]
    assert all(torch.equal(s, e) for s, e in zip(stops, expected, strict=True))
    assert not stops[0][0] and stops[0][1]  # the unsure row stops first
    features, predictions = policy.round_features()
    assert features.shape == (2, 3) and torch.allclose(predictions[:, 0], a)
    assert torch.equal(policy.last_accept, a)
    # one row at a time: the same decisions
    for row in range(2):
        policy.begin_round()
        assert [policy.should_stop(k, confident[row], None) for k in (1, 2, 3)] == [bool(s[row]) for s in stops]
    policy.begin_round()
    assert policy.round_features() is None and policy.last_accept is None
    assert OnlineAcceptance(**policy.settings()).settings() == policy.settings()
    with pytest.raises(ValueError, match=r"threshold must be a number in \[0, 1\]"):
        OnlineAcceptance(threshold=math.nan)
