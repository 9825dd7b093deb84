"""The what-if grid over a dataset's acceptance labels: specdecpp.analysis.potential.whatif_grid and
python -m infer.potential DATA --whatif-gammas ... (was scripts/potential_whatif.py)."""

from __future__ import annotations

import numpy as np
import pytest

from infer import potential as cli
from specdecpp.analysis import potential as pt
from specdecpp.analysis.costmodel import Costs, expected_tokens_per_round


def test_constant_acceptance_fixed_k_follows_the_closed_form_and_a_perfect_head_cannot_win():
    """i.i.d. acceptance alpha: fixed K's tokens per round is (1 - alpha^(K+1)) / (1 - alpha), so its
    Eq. 2.3 speedup is known; a perfect head that knows P_i = alpha learns nothing per position,
    so it can only mimic some fixed K (it is never ahead by more than sampling noise)."""
    rows = [{"p_acc": np.full(2000, 0.6), "draft_entropy": np.zeros(2000)} for _ in range(4)]
    (rec,) = pt.whatif_grid(rows, [1.0], [0.1], seeds=2)
    k = int(rec["fixed_k"]["setting"].split("=")[1])
    tpr = expected_tokens_per_round(0.6, k)
    # Eq. 2.3 with verification 1 / tpr and discard (K - (tpr - 1)) / tpr
    closed = 1 / (0.1 + 0.1 * (k - (tpr - 1)) / tpr + 0.9 / tpr)
    assert rec["fixed_k"]["speedup"] == pytest.approx(closed, rel=0.01)
    assert closed == pytest.approx(max(1 / (0.1 + 0.1 * (j - expected_tokens_per_round(0.6, j) + 1)
                                            / expected_tokens_per_round(0.6, j)
                                            + 0.9 / expected_tokens_per_round(0.6, j)) for j in range(1, 11)))
    assert rec["informed"]["margin"] < 0.01 and rec["informed_lag_free"]["margin"] < 0.01
    assert rec["oracle"]["margin"] > 0.2  # hindsight still wins: it sees the coin flips


def test_raising_the_labels_raises_acceptance_and_keeps_their_order():
    rng = np.random.default_rng(0)
    rows = [{"p_acc": rng.beta(0.6, 0.9, 300), "draft_entropy": rng.random(300)} for _ in range(6)]
    recs = pt.whatif_grid(rows, [1.0, 0.5, 0.25], [0.05], seeds=2)
    means = [r["mean_acceptance"] for r in recs]
    assert means[0] == pytest.approx(np.concatenate([r["p_acc"] for r in rows]).mean())
    assert means[0] < means[1] < means[2]
    out = pt.raise_labels(rows, 0.5)
    assert np.array_equal(np.argsort(out[0]["p_acc"]), np.argsort(rows[0]["p_acc"]))
    # varied acceptances: the perfect head without the lag beats fixed K, and more so as P rises
    margins = [r["informed_lag_free"]["margin"] for r in recs]
    assert margins[0] > 0.02
    assert recs[-1]["informed"]["speedup"] > recs[0]["informed"]["speedup"]
    with pytest.raises(ValueError, match="gamma"):
        pt.raise_labels(rows, 0.0)


def test_whatif_matches_infer_potential_at_gamma_one(tmp_path):
    """gamma = 1 is the dataset itself: the best fixed K and informed speedups equal what the
    potential module's own policies give on the same rows."""
    rng = np.random.default_rng(1)
    rows = [{"p_acc": rng.beta(0.7, 0.8, 200), "draft_entropy": rng.random(200)} for _ in range(5)]
    (rec,) = pt.whatif_grid(rows, [1.0], [0.08], seeds=3)
    policies = [pt.fixed_k(k) for k in range(1, 11)] + [pt.informed(h) for h in pt.WHATIF_THRESHOLDS]
    counts = pt.simulate(rows, policies, seeds=range(3))
    records = pt.summarise(counts, policies, Costs.from_ratio(0.08), n_boot=10)
    assert rec["fixed_k"]["speedup"] == pytest.approx(pt.best(records, "fixed_k")["speedup"])
    assert rec["informed"]["speedup"] == pytest.approx(pt.best(records, "informed")["speedup"])


def test_cli_writes_its_files_adds_the_measured_ratio_and_names_bad_input(tiny_pair, tmp_path):
    import json

    from tests.helpers.train import random_rows, save_dataset

    data = save_dataset(tmp_path / "data", {"test": random_rows(8, tiny_pair.vocab, 3, max_len=30)},
                        tiny_pair.draft, 32, tiny_pair.vocab)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"t_draft": 0.005, "t_target": 0.05}))
    out = tmp_path / "whatif"
    cli.main([str(data), "--split", "test", "--whatif-gammas", "1", "0.5", "--whatif-ratios", "0.05", "0.02",
              "--costs", str(costs), "--seeds", "2", "--out", str(out)])
    records = json.loads((out / "whatif.json").read_text())
    assert [(r["gamma"], r["cost_ratio"]) for r in records] == [(g, c) for g in (1.0, 0.5) for c in (0.1, 0.05, 0.02)]
    assert records[0]["mean_acceptance"] < records[3]["mean_acceptance"]
    assert "| mean P |" in (out / "whatif.md").read_text()
    assert (out / "whatif.png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match=r"cost ratios must be in \[0, 1\), got \[1.5\]"):
        cli.main([str(data), "--whatif-gammas", "1", "--whatif-ratios", "1.5", "--out", str(out)])
    with pytest.raises(SystemExit, match="no split 'dev'"):
        cli.main([str(data), "--split", "dev", "--whatif-gammas", "1", "--cost-ratio", "0.1", "--out", str(out)])
    with pytest.raises(SystemExit, match="needs a cost ratio"):
        cli.main([str(data), "--whatif-gammas", "1", "--out", str(out)])
    with pytest.raises(SystemExit, match="gamma must be > 0"):
        cli.main([str(data), "--whatif-gammas", "0", "--cost-ratio", "0.1", "--out", str(out)])
