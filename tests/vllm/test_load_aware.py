"""specdecpp.vllm.load_aware: the step-cost curves, the choice of every request's length that maximises
a step's expected committed tokens per second (against brute force), its online form, and the inputs
it refuses. Pure torch: runs without vLLM."""

from __future__ import annotations

import itertools
import json
import math
import random
import time

import pytest
import torch

from specdecpp.vllm.load_aware import (
    LengthChoice,
    OnlineLengths,
    StepCosts,
    choose_lengths,
    expected_committed,
    measure_curve,
    measure_step_costs,
    step_seconds,
)

FLAT = StepCosts((1,), (1.0,), (1,), (0.0,))  # the target costs the same at any load, drafting nothing


def steep(knee: int = 16) -> StepCosts:
    """Flat up to ``knee`` tokens (memory-bound), then 1/16 s a token (compute-bound); a cheap draft."""
    return StepCosts((1, knee, 4 * knee), (1.0, 1.0, 1.0 + 3 * knee / 16), (1, 256), (0.01, 0.05))


def brute(a, costs, caps, draft) -> float:
    return max(expected_committed(a, lengths) / step_seconds(lengths, costs, draft)
               for lengths in itertools.product(*[range(c + 1) for c in caps]))


def random_case(rng: random.Random, rows: int, positions: int):
    a = torch.tensor([[rng.random() ** 0.5 for _ in range(positions)] for _ in range(rows)], dtype=torch.float64)
    caps = [rng.randint(0, positions) for _ in range(rows)]
    tx = sorted(rng.sample(range(1, 25), 3))
    target = (tx, sorted(rng.uniform(0.5, 3.0) for _ in tx))
    return a, caps, target


def test_a_curve_is_piecewise_linear_flat_before_and_continued_after():
    costs = StepCosts((4, 8, 16), (1.0, 2.0, 2.5), (1, 4), (0.1, 0.4))
    assert costs.target(torch.tensor([1, 4, 6, 8, 12, 16, 32])).tolist() == pytest.approx(
        [1.0, 1.0, 1.5, 2.0, 2.25, 2.5, 3.5])
    assert costs.draft(torch.tensor([0, 1, 2, 8])).tolist() == pytest.approx([0.0, 0.1, 0.2, 0.8])
    assert StepCosts((3,), (0.5,), (1,), (0.2,)).target(100).item() == 0.5
    assert costs.draft_is_affine and not StepCosts((1, 2, 3), (1, 2, 2), (2, 4), (1, 2)).draft_is_affine
    assert not StepCosts((1,), (1,), (1, 2), (1.0, 3.0)).draft_is_affine  # draft(n) = 2n - 1: no overhead


def test_step_costs_save_and_load(tmp_path):
    costs = StepCosts((1, 64), (0.01, 0.02), (1, 8, 32), (0.001, 0.002, 0.004), meta={"machine": "x"})
    path = costs.save(tmp_path / "costs" / "step_costs.json")
    assert StepCosts.load(path) == costs and StepCosts.load(path).meta == {"machine": "x"}
    (tmp_path / "bad.json").write_text(json.dumps({"format": 1, "target_tokens": [1]}))
    with pytest.raises(ValueError, match="missing target_seconds, draft_batch, draft_seconds"):
        StepCosts.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="step-costs file"):
        StepCosts.load(tmp_path / "none.json")


@pytest.mark.parametrize(("args", "match"), [
    (((1, 8), (1.0, 0.5), (1,), (0.1,)), "target curve seconds must be >= 0 and not decrease"),
    (((1,), (1.0,), (1, 4), (0.2, 0.1)), "draft curve seconds must be >= 0 and not decrease"),
    (((1, 1), (1.0, 1.0), (1,), (0.1,)), "target curve sizes must be strictly increasing"),
    (((0, 4), (1.0, 1.0), (1,), (0.1,)), "target curve sizes must be strictly increasing from 1"),
    (((), (), (1,), (0.1,)), "target curve needs one or more"),
    (((1, 2), (1.0,), (1,), (0.1,)), "target curve needs one or more .* 2 sizes and 1 times"),
    (((1,), (float("nan"),), (1,), (0.1,)), "target curve has a non-finite point"),
])
def test_bad_curves_are_refused_naming_the_curve(args, match):
    with pytest.raises(ValueError, match=match):
        StepCosts(*args)


def test_measured_curves_follow_the_forward_and_do_not_fall():
    calls = []

    def forward(n):
        calls.append(n)
        time.sleep(2e-4 * n)

    sizes, seconds = measure_curve(forward, [40, 1, 20], repeats=2, warmup=1)
    assert sizes == (1.0, 20.0, 40.0) and set(calls) == {1, 20, 40}
    assert all(s >= 2e-4 * n for n, s in zip(sizes, seconds, strict=True))
    assert seconds[2] > seconds[0]
    # a forward that gets faster with size (noise): the running maximum keeps the curve monotone
    _, falling = measure_curve(lambda n: time.sleep(0.004 / n), [1, 4], repeats=1, warmup=0)
    assert falling[1] == falling[0]
    _, raw = measure_curve(lambda n: time.sleep(0.004 / n), [1, 4], repeats=1, warmup=0, monotone=False)
    assert raw[1] < raw[0]
    costs = measure_step_costs(lambda n: time.sleep(1e-4 * n), lambda b: time.sleep(1e-4 * b), [1, 32], [1, 8],
                               repeats=1, meta={"what": "fake"})
    assert costs.target(32) > costs.target(1) and costs.meta["what"] == "fake" and "machine" in costs.meta
    with pytest.raises(ValueError, match="sizes must be integers >= 1"):
        measure_curve(forward, [0, 4])


@pytest.mark.parametrize("draft", ["dense", "active"])
def test_the_choice_equals_brute_force(draft):
    """Exact in dense mode, and in active mode with an affine draft curve (overhead >= 0)."""
    rng = random.Random(0)
    for _ in range(120):
        a, caps, (tx, ty) = random_case(rng, rng.randint(1, 4), rng.randint(1, 3))
        d0, d1 = rng.uniform(0, 0.5), rng.uniform(0, 0.5)
        dx, dy = ((1, 2), (d0 + d1, d0 + 2 * d1)) if draft == "active" else \
            (sorted(rng.sample(range(1, 6), 3)), sorted(rng.uniform(0.01, 1.0) for _ in range(3)))
        costs = StepCosts(tx, ty, dx, dy)
        choice = choose_lengths(a, costs, caps, draft)
        assert all(0 <= n <= c for n, c in zip(choice.lengths, caps, strict=True))
        assert choice.committed == pytest.approx(expected_committed(a, choice.lengths))
        assert choice.seconds == pytest.approx(step_seconds(choice.lengths, costs, draft))
        assert choice.rate == pytest.approx(brute(a, costs, caps, draft), rel=1e-9)


def test_active_mode_with_a_curved_draft_cost_is_close_to_brute_force():
    """Not proven exact there (the module docstring): measured."""
    rng = random.Random(1)
    ratios = []
    for _ in range(150):
        a, caps, (tx, ty) = random_case(rng, rng.randint(1, 5), rng.randint(1, 3))
        dx = sorted(rng.sample(range(1, 7), 3))
        costs = StepCosts(tx, ty, dx, sorted(rng.uniform(0.01, 1.0) for _ in dx))
        ratios.append(choose_lengths(a, costs, caps, "active").rate / brute(a, costs, caps, "active"))
    assert max(ratios) <= 1 + 1e-9
    assert min(ratios) > 0.9 and sum(r > 1 - 1e-9 for r in ratios) >= 0.95 * len(ratios)  # 0.936; 146 of 150


def test_at_a_flat_target_cost_the_choice_is_the_policys_own_stop():
    """Verifying more costs nothing and drafting is free: each request drafts up to its policy's stop."""
    torch.manual_seed(0)
    for rows in (1, 7, 64):
        a = torch.rand(rows, 6) * 0.98 + 0.01
        stops = torch.randint(0, 7, (rows,))
        assert choose_lengths(a, FLAT, stops).lengths == tuple(stops.tolist())
        online = OnlineLengths(FLAT, rows, 6)
        for k in range(6):
            if online.done:
                break
            online.step(a[:, k], caps=stops.clamp(min=1))
        assert online.lengths.tolist() == stops.clamp(min=1).tolist()  # a head's lengths are >= 1 (droppable=False)


def test_with_a_steep_target_cost_lengths_shrink_to_zero_as_requests_grow():
    a = torch.full((1, 8), 0.8)
    mean_lengths = [sum(choose_lengths(a.expand(rows, 8), steep(), draft=mode).lengths) / rows
                    for mode in ("dense", "active") for rows in (1, 2, 4, 8, 16, 32, 64)]
    for mode_lengths in (mean_lengths[:7], mean_lengths[7:]):
        assert mode_lengths[0] == 8 and mode_lengths[-1] == 0
        assert all(b <= a for a, b in itertools.pairwise(mode_lengths)), mode_lengths
    # and a request that is more likely to be accepted keeps a longer draft than the others
    mixed = torch.tensor([[0.95] * 8, [0.5] * 8] * 4)
    lengths = choose_lengths(mixed, steep(8)).lengths
    assert min(lengths[0::2]) > max(lengths[1::2])


def test_the_online_form_equals_the_choice_with_exact_predictions():
    """Dense mode, each row's acceptance constant over positions: re-planning after every pass gives
    the lengths chosen ahead (when those draft at all)."""
    rng = random.Random(2)
    compared = 0
    for _ in range(150):
        rows, positions = rng.randint(1, 6), rng.randint(1, 4)
        a = (torch.rand(rows, 1, generator=torch.Generator().manual_seed(rng.randrange(10**6))) ** 0.3).expand(
            rows, positions).double()
        tx = sorted(rng.sample(range(1, 30), 3))
        d = rng.uniform(0.01, 0.3)
        costs = StepCosts(tx, sorted(rng.uniform(0.5, 3.0) for _ in tx), (1, 8), (d, 1.5 * d))
        ahead = choose_lengths(a, costs)
        if max(ahead.lengths) == 0:
            continue
        online = OnlineLengths(costs, rows, positions)
        k = 0
        while not online.done:
            keep, more = online.step(a[:, k], droppable=True)
            assert not (more & ~keep).any()
            k += 1
        assert tuple(online.lengths.tolist()) == ahead.lengths
        compared += 1
    assert compared > 50


def test_the_online_form_keeps_candidates_it_may_not_drop():
    """droppable=False (a lag-free head reads the candidate it scores): a drafted candidate is kept,
    only the next one is decided; under a steep cost at 64 rows every row still keeps its first."""
    online = OnlineLengths(steep(), 64, 4)
    keep, more = online.step(torch.full((64,), 0.8))
    assert keep.all() and not more.any() and online.done and online.lengths.tolist() == [1] * 64
    online = OnlineLengths(steep(), 64, 4)
    keep, more = online.step(torch.full((64,), 0.8), droppable=True)
    assert not keep.any() and online.lengths.tolist() == [0] * 64


def test_choose_lengths_is_fast_at_256_requests_by_8_positions():
    torch.manual_seed(0)
    a = torch.rand(256, 8)
    costs = StepCosts((1, 64, 512, 2048), (0.01, 0.012, 0.05, 0.2), (1, 256), (0.002, 0.004))
    for mode in ("dense", "active"):
        began = time.perf_counter()
        choice = choose_lengths(a, costs, draft=mode)
        assert time.perf_counter() - began < 1.0  # ~10 ms here; a loose bound for a loaded CI machine
        assert isinstance(choice, LengthChoice) and len(choice.lengths) == 256 and math.isfinite(choice.rate)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"accept_probs": [[0.5, float("nan")]]}, r"accept_probs must hold probabilities in \[0, 1\] \(no NaN\)"),
    ({"accept_probs": [[0.5, 1.5]]}, r"accept_probs must hold probabilities in \[0, 1\]"),
    ({"accept_probs": torch.empty(0, 3)}, "accept_probs must be a .* at least one request, got shape \\(0, 3\\)"),
    ({"accept_probs": [0.5, 0.5]}, "accept_probs must be a \\[requests, positions\\] table"),
    ({"max_lengths": [1, 4]}, r"max_lengths must lie in 0..3"),
    ({"max_lengths": [1]}, "max_lengths must be 2 integers"),
    ({"max_lengths": [1.0, 2.0]}, "max_lengths must be 2 integers"),
    ({"draft": "sparse"}, "draft must be one of"),
])
def test_bad_input_is_refused_naming_it(kwargs, match):
    call = {"accept_probs": [[0.9, 0.8, 0.5], [0.4, 0.3, 0.2]], "costs": steep(), **kwargs}
    with pytest.raises(ValueError, match=match):
        choose_lengths(**call)
    with pytest.raises(TypeError, match="costs must be a StepCosts"):
        choose_lengths([[0.5]], {"target": 1})


def test_the_online_form_refuses_bad_input():
    online = OnlineLengths(steep(), 2, 1)
    with pytest.raises(ValueError, match="accept must hold 2 estimates"):
        online.step([0.5])
    with pytest.raises(ValueError, match=r"accept must hold probabilities in \[0, 1\] \(no NaN\)"):
        OnlineLengths(steep(), 2, 1).step([0.5, float("nan")])
    online.step([0.5, 0.5])
    with pytest.raises(ValueError, match="pass 2 is beyond max_len=1"):
        online.step([0.5, 0.5])
    with pytest.raises(ValueError, match="batch must be an integer >= 1"):
        OnlineLengths(steep(), 0, 4)
