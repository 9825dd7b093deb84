"""specdecpp.analysis.costmodel: the Eq. 2.1 fit, Eq. 2.3, the width curve t_target(n), and the one
costs.json with its loader."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdecpp.analysis.costmodel import (
    SCHEMA,
    Costs,
    expected_tokens_per_round,
    fit_cost_model,
    fixed_k_speedup,
    latency_by_width,
    load_costs,
    predicted_latency_per_token,
    save_costs,
    speedup_over_target_only,
)


def test_eq23_forms_agree_and_work_on_arrays():
    # over target-only, Eq. 2.3 at ratio c is the latency with t_draft = c, t_target = 1, inverted
    assert speedup_over_target_only(0.1, 0.2, 0.4) == pytest.approx(1 / predicted_latency_per_token(0.1, 1.0, 0.2, 0.4))
    assert speedup_over_target_only(0.1, 0.2, 0.4) == pytest.approx(1 / (0.1 + 0.1 * 0.2 + 0.9 * 0.4))
    arr = speedup_over_target_only(0.1, np.array([0.2, 0.0]), np.array([0.4, 1.0]))
    np.testing.assert_allclose(arr, [1 / (0.1 + 0.02 + 0.36), 1.0])
    # fixed K under i.i.d. acceptance: tokens per round over the round's K c + 1 target passes
    assert fixed_k_speedup(0.0, 0.2, 3) == pytest.approx(1 / 1.6)
    assert fixed_k_speedup(0.5, 0.2, 2) == pytest.approx(1.75 / 1.4)
    assert fixed_k_speedup(1.0, 0.0, 4) == pytest.approx(5.0)
    assert fixed_k_speedup(0.6, 0.1, 3) == pytest.approx(expected_tokens_per_round(0.6, 3) / 1.3)


def test_width_curve_interpolates_and_prices_rounds():
    costs = Costs(0.1, 1.0, {1: 1.0, 2: 1.2, 4: 1.8})
    assert costs.target_cost(3) == pytest.approx(1.5)  # linear between measured widths
    assert costs.target_cost(9) == pytest.approx(1.8)  # held flat beyond
    np.testing.assert_allclose(costs.target_cost(np.array([1, 3])), [1.0, 1.5])
    # 40 rounds of 2 candidates (3 tokens each) and 10 of 0 candidates
    assert costs.verification_cost({2: 40, 0: 10}) == pytest.approx(40 * 1.5 + 10 * 1.0)
    assert latency_by_width(costs, 100, 80, 70.0) == pytest.approx((0.1 * 80 + 70.0) / 100)
    with pytest.raises(ValueError, match="target_by_width"):
        Costs(0.1, 1.0).target_cost(1)


def test_costs_json_round_trip_keeps_curve_and_provenance(tmp_path):
    costs = Costs(0.002, 0.05, {1: 0.05, 2: 0.06, 8: 0.09}, {"device": "cpu", "dtype": "bfloat16", "threads": 1})
    path = save_costs(costs, tmp_path / "sub" / "costs.json")
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["target_by_width"] == {"1": 0.05, "2": 0.06, "8": 0.09}
    back = load_costs(path)
    assert back == costs and dict(back.meta) == {"device": "cpu", "dtype": "bfloat16", "threads": 1}
    assert back.ratio == pytest.approx(0.04)


def test_older_files_and_report_summaries_load(tmp_path):
    old = tmp_path / "old.json"  # what scripts/measure_pair.py --costs-out wrote (no schema key)
    old.write_text(json.dumps({"t_draft": 0.0021, "t_target": 0.0157, "target_by_width": {"1": 0.0157, "2": 0.0171},
                               "dtype": "bfloat16", "measured_by": "scripts/measure_pair.py", "threads": 1}))
    costs = load_costs(old)
    assert costs.target_by_width == {1: 0.0157, 2: 0.0171} and costs.meta["measured_by"] == "scripts/measure_pair.py"
    summary = tmp_path / "summary.json"  # infer.report's: a list of groups, the first fitted one counts
    summary.write_text(json.dumps([{"fit": None},
                                   {"fit": {"t_draft": 0.01, "t_target": 0.1, "r2": 0.99, "n_rows": 8}}]))
    costs = load_costs(summary)
    assert (costs.t_draft, costs.t_target, costs.target_by_width) == (0.01, 0.1, None)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"t_draft": 0.1}), "needs keys t_draft and t_target"),
    (json.dumps({"t_draft": 0.2, "t_target": 0.1}), "0 < t_draft < t_target"),
    (json.dumps({"t_draft": "fast", "t_target": 0.1}), "must be numbers"),
    (json.dumps({"t_draft": 0.01, "t_target": 0.1, "target_by_width": {"0": 0.1}}), "widths >= 1"),
    (json.dumps({"schema": "specdecpp.costs/9", "t_draft": 0.01, "t_target": 0.1}), "unknown schema"),
    (json.dumps([1, 2]), "JSON object"),
    (json.dumps([{"fit": None}]), "no fitted cost model"),
])
def test_a_malformed_costs_file_is_named(tmp_path, content, message):
    path = tmp_path / "mine.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as exc:
        load_costs(path)
    assert "mine.json" in str(exc.value)


def test_a_missing_costs_file_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.json.*python -m infer\.costs"):
        load_costs(tmp_path / "nope.json")


def test_fit_cost_model_recovers_known_costs():
    rng = np.random.default_rng(0)
    n_draft, n_target = rng.integers(0, 400, 60), rng.integers(20, 130, 60)
    wall = 0.0234 * n_draft + 0.112 * n_target
    fit = fit_cost_model(n_draft, n_target, wall)
    assert fit.t_draft == pytest.approx(0.0234, rel=1e-9) and fit.t_target == pytest.approx(0.112, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.n_rows == 60
    noisy = fit_cost_model(n_draft, n_target, wall + rng.normal(0, 0.05, 60))
    assert noisy.t_draft == pytest.approx(0.0234, rel=0.05) and noisy.t_target == pytest.approx(0.112, rel=0.05)
    assert 0.98 < noisy.r2 < 1.0
    with pytest.raises(ValueError, match="proportional"):
        fit_cost_model([1, 2, 3], [2, 4, 6], [1.0, 2.0, 3.0])


def test_eq_2_3_equals_eq_2_1_per_token():
    t_d, t_t, n, n_draft, n_target = 0.02, 0.1, 100, 180, 40
    n_discarded = n_draft + n_target - n
    per_token = (t_d * n_draft + t_t * n_target) / n
    assert predicted_latency_per_token(t_d, t_t, n_discarded / n, n_target / n) == pytest.approx(per_token)
