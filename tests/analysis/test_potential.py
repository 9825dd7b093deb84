"""The stop-potential simulator against closed forms and hand-counted rounds, the greedy oracle,
and its CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from infer import potential as cli
from specdecpp.analysis import potential as pt
from specdecpp.analysis.costmodel import Costs, expected_tokens_per_round
from specdecpp.analysis.potential import greedy_oracle
from specdecpp.stopping.head import AcceptanceHead
from tests.helpers.train import random_rows, save_dataset


def iid_row(n: int, alpha: float) -> dict:
    return {"p_acc": np.full(n, alpha), "draft_entropy": np.ones(n)}


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.85])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_fixed_k_matches_the_closed_form_for_iid_acceptance(alpha, k):
    n = 60_000
    counts = pt.simulate([iid_row(n, alpha)], [pt.fixed_k(k)], seeds=[0])[pt.fixed_k(k).label][0]
    expected_tokens = expected_tokens_per_round(alpha, k)  # (1 - a^(K+1)) / (1 - a)
    expected_accepted = sum(alpha**j for j in range(1, k + 1))
    # one standard error of the mean tokens per round is at most sqrt(k^2 / rounds); 5 of them
    tol = 5 * k / np.sqrt(n / expected_tokens)
    assert counts.tokens_per_round == pytest.approx(expected_tokens, abs=tol)
    assert counts.discarded / counts.rounds == pytest.approx(k - expected_accepted, abs=tol)
    assert counts.widths.get(k, 0) >= counts.rounds - k  # only rounds near the end are capped
    assert counts.drafted == sum(w * r for w, r in counts.widths.items())
    # the paper's identity N_draft + N_target = N + N_discarded
    assert counts.drafted + counts.rounds == counts.tokens + counts.discarded


def test_rounds_replayed_by_hand():
    p = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=float)  # deterministic: u < P iff P == 1
    row = {"p_acc": p, "draft_entropy": np.zeros(10)}
    res = pt.simulate([row], [pt.fixed_k(2), pt.informed(0.5), pt.oracle()], seeds=[0])
    # fixed K=2: rounds at s=0 (acc 2, emits 3), s=3 (acc 2), s=6 (rejects at 6: acc 0), s=7 (acc 2 -> done)
    k2 = res["fixed_k k=2"][0]
    assert (k2.rounds, k2.drafted, k2.discarded) == (4, 8, 2)
    # oracle: s=0 drafts 2 (stops before the rejection at 2), s=3 drafts 3, s=7 drafts 2 (cap n-s-1)
    orc = res["oracle"][0]
    assert (orc.rounds, orc.drafted, orc.discarded) == (3, 7, 0)
    # informed: the stop test after candidate k multiplies P of candidates 1..k-1 (the head's lag), so
    # it drafts one candidate past a rejection: s=0: K=4 (P_2 = 0 seen at k=4), 2 accepted, 2 discarded;
    # s=3: K=5 (P_6 = 0 seen at k=5), 3 accepted; s=7: K=2 (capped), 2 accepted
    inf = res["informed threshold=0.5"][0]
    assert (inf.rounds, inf.drafted, inf.discarded) == (3, 11, 4)
    # without the lag the perfect head stops right at the rejected candidate: one discard per rejection
    free = pt.simulate([row], [pt.informed_lag_free(0.5)], seeds=[0])["informed_lag_free threshold=0.5"][0]
    assert (free.rounds, free.drafted, free.discarded) == (3, 9, 2)
    for c in (k2, orc, inf):
        assert c.drafted + c.rounds == c.tokens + c.discarded


def test_a_feature_drafts_labels_by_depth_are_read_at_each_candidates_depth():
    """Labels by depth [N, D]: a round's j-th candidate is accepted by its label at depth j (D past
    it). Here depth 1 always accepts and deeper ones never: every round accepts exactly its first
    candidate, whatever K; SVIP and the perfect head read the same depth's column; equal depths
    replay the 1-D labels exactly."""
    n = 12
    p = np.zeros((n, 3))
    p[:, 0] = 1.0
    ent = np.zeros((n, 3))
    ent[:, 1] = 100.0  # SVIP stops after a second candidate, never after a first
    row = {"p_acc": p, "draft_entropy": ent}
    res = pt.simulate([row], [pt.fixed_k(3), pt.svip(0.5), pt.informed_lag_free(0.5), pt.oracle()], seeds=[0])
    for label, widths in (("fixed_k k=3", {3, 1}), (pt.svip(0.5).label, {2, 1}),
                          ("informed_lag_free threshold=0.5", {2, 1}), ("oracle", {1})):
        c = res[label][0]
        assert c.drafted - c.discarded == c.rounds, label  # exactly the first candidate of each round accepted
        assert set(c.widths) == widths, (label, c.widths)  # the last round is capped at 1 candidate
    rng = np.random.default_rng(0)
    flat = rng.random(40)
    same = {"p_acc": np.repeat(flat[:, None], 4, axis=1), "draft_entropy": np.repeat(flat[:, None], 4, axis=1)}
    policies = [pt.fixed_k(2), pt.fixed_k(6), pt.svip(0.3), pt.informed(0.4), pt.oracle()]
    a = pt.simulate([same], policies, seeds=[0, 1])
    b = pt.simulate([{"p_acc": flat, "draft_entropy": flat}], policies, seeds=[0, 1])
    for policy in policies:
        ca, cb = a[policy.label][0], b[policy.label][0]
        assert (ca.rounds, ca.drafted, ca.discarded, ca.widths) == (cb.rounds, cb.drafted, cb.discarded, cb.widths)


def test_informed_head_with_hard_labels_has_the_oracles_rounds_and_two_discards_per_rejection():
    rng = np.random.default_rng(0)
    rows = [{"p_acc": (rng.random(200) < 0.7).astype(float), "draft_entropy": np.ones(200)} for _ in range(5)]
    res = pt.simulate(rows, [pt.informed(0.5), pt.oracle()], seeds=[0])
    for inf, orc in zip(res["informed threshold=0.5"], res["oracle"], strict=True):
        assert inf.rounds == orc.rounds
        assert orc.discarded == 0
        assert inf.discarded <= 2 * inf.rounds


def test_svip_stops_on_entropy_and_heads_follow_their_predictions():
    n = 50
    entropy = np.where(np.arange(n) % 3 == 2, 4.0, 0.01)  # sqrt(0.15 * 4) = 0.77 > 0.5 at every third
    row = {"p_acc": np.ones(n), "draft_entropy": entropy, "pred:h": np.ones(n)}
    res = pt.simulate([row], [pt.svip(0.5), pt.head_rule("h", 0.5, max_candidates=20)], seeds=[0])
    svip_counts = res["svip threshold=0.5"][0]
    assert set(svip_counts.widths) <= {0, 1, 2, 3}  # stops at the first high-entropy candidate (0: the last token)
    # 0..2, then 4..5, 7..8, ... (bonus tokens at 3, 6, ...)
    assert svip_counts.widths[3] == 1 and svip_counts.widths[2] == 15
    head_counts = res["head:h threshold=0.5"][0]  # a head sure of acceptance drafts to the cap
    assert max(head_counts.widths) == 20


def test_eq23_speedup_and_width_costs():
    c = pt.Counts(tokens=100, rounds=40, drafted=80, discarded=20, widths={2: 40})
    assert pt.speedup_eq23(c, 0.1) == pytest.approx(1 / (0.1 + 0.1 * 0.2 + 0.9 * 0.4))
    # width-dependent: 80 draft forwards of 1 + 40 verifications of 3 tokens (cost 1.5) vs 100 x 1.0
    costs = Costs(0.1, 1.0, {1: 1.0, 2: 1.2, 4: 1.8})
    assert pt.speedup_by_width(c, costs) == pytest.approx(100 / (0.1 * 80 + 40 * 1.5))
    # with a flat curve the width form is Eq. 2.3 with the same ratio
    flat = Costs(0.1, 1.0, {1: 1.0, 8: 1.0})
    assert pt.speedup_by_width(c, flat) == pytest.approx(pt.speedup_eq23(c, 0.1))
    with pytest.raises(ValueError, match="cost ratio"):
        Costs.from_ratio(1.5)
    with pytest.raises(ValueError, match=r"informed: threshold must be a number in \[0, 1\]"):
        pt.informed(1.2)


def test_bootstrap_interval_covers_the_point_and_shrinks_with_more_prompts():
    rows = [iid_row(64, a) for a in np.tile([0.2, 0.8], 20)]  # any 4 prompts vary as much as all 40
    res = pt.simulate(rows, [pt.fixed_k(3)], seeds=[0, 1])["fixed_k k=3"]
    point = pt.speedup_eq23(pt._sum(res), 0.1)
    lo, hi = pt.speedup_interval(res, Costs.from_ratio(0.1), n_boot=300)
    lo4, hi4 = pt.speedup_interval(res[:4], Costs.from_ratio(0.1), n_boot=300)
    assert lo < point < hi
    assert hi - lo < hi4 - lo4


@pytest.fixture(scope="module")
def potential_dataset(tiny_pair, tmp_path_factory):
    splits = {"train": random_rows(12, tiny_pair.vocab, 1, max_len=30),
              "test": random_rows(16, tiny_pair.vocab, 3, max_len=30)}
    return save_dataset(tmp_path_factory.mktemp("pot_data"), splits, tiny_pair.draft, 32, tiny_pair.vocab)


def test_cli_writes_table_json_and_png_with_a_trained_head(potential_dataset, tmp_path):
    head_dir = tmp_path / "wrej6_d1"
    torch.manual_seed(0)
    AcceptanceHead(32, 1).save_pretrained(head_dir)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"t_draft": 0.002, "t_target": 0.05,
                                 "target_by_width": {"1": 0.05, "2": 0.06, "4": 0.07}}))
    out = tmp_path / "pot"
    config = cli.PotentialConfig(split="test", seeds=2, max_k=4, thresholds=(0.3, 0.7), svip_thresholds=(0.3,),
                                 n_boot=50, quiet=True)
    result = cli.run(str(potential_dataset), config, costs_file=str(costs), heads=[str(head_dir)], out=str(out))
    payload = json.loads((out / "potential.json").read_text())
    names = [r["name"] for r in payload["records"]]
    assert names.count("fixed_k") == 4 and names.count("informed") == 2 and names.count("head:wrej6_d1") == 2
    assert {"oracle", "svip"} <= set(names)
    for r in payload["records"]:
        assert {"name", "settings", "verification_rate", "discard_rate", "speedup", "speedup_by_width"} <= set(r)
        assert r["speedup_ci95"][0] <= r["speedup"] <= r["speedup_ci95"][1] + 1e-9
    oracle = next(r for r in payload["records"] if r["name"] == "oracle")
    assert oracle["discard_rate"] == 0
    assert all(oracle["verification_rate"] <= r["verification_rate"] for r in payload["records"])
    assert "informed" in result["margins"]
    md = (out / "potential.md").read_text()
    assert "| fixed_k | k=1 |" in md and "t_target(n)" in md
    # a weak pair is told where to look next (the what-if grid), a strong one is not
    assert ("--whatif-gammas" in md) == (result["margins"]["informed"]["margin"] < cli.WHATIF_BELOW)
    assert (out / "potential.png").stat().st_size > 10_000
    # every policy's best against the best fixed K at the width curve, recomputed by hand from the counts
    by_width = result["margins_by_width"]
    assert set(by_width) == {"informed", "informed_lag_free", "svip", "head:wrej6_d1"}
    assert payload["margins_vs_best_fixed_k_by_width"].keys() == by_width.keys()
    def t_target(n):  # linear between the measured widths 1, 2, 4; flat beyond
        return {1: 0.05, 2: 0.06, 3: 0.065}.get(n, 0.07)

    def by_hand(rec):  # target-only latency / latency per token, from the record's counts
        c = rec["counts"]
        verify = sum(r * t_target(int(k) + 1) for k, r in c["widths"].items())
        return 0.05 / ((0.002 * c["drafted"] + verify) / c["tokens"])

    recs = {r["label"]: r for r in payload["records"]}
    fixed = max((r for r in payload["records"] if r["name"] == "fixed_k"), key=by_hand)
    for name, m in by_width.items():
        best = recs[m["setting"]]
        assert best["name"] == name
        assert by_hand(best) == pytest.approx(max(by_hand(r) for r in payload["records"] if r["name"] == name))
        assert m["margin"] == pytest.approx(by_hand(best) / by_hand(fixed) - 1)
        lo, hi = m["ci95"]
        assert lo <= m["margin"] <= hi + 1e-9
        assert f"with t_target(n): {name} best {m['setting']}" in md and "95% CI" in md


def test_head_predictions_cover_every_position_and_equal_the_head_on_the_engines_features(
        potential_dataset, tmp_path, tiny_pair):
    from specdecpp.models.loading import load_model
    from specdecpp.training.mixing import draft_features

    head = AcceptanceHead(32, 0)
    torch.nn.init.normal_(head.out.weight, std=1.0)
    head.save_pretrained(tmp_path / "h")
    rows, meta, raw = cli.dataset_rows(potential_dataset, "test")
    preds = cli.head_predictions(str(tmp_path / "h"), raw, meta)
    assert all(not np.isnan(p).any() and len(p) == len(r["p_acc"]) for p, r in zip(preds, rows, strict=True))
    # at a position that epoch 0's mixing keeps as the draft token, the prediction is the head on
    # the hidden state of x + Z_1..Z_i, recomputed here from scratch
    from specdecpp.training.mixing import mixed_example, mixing_mask

    draft = load_model(tiny_pair.draft, "cpu")
    r = raw[0]
    mask = mixing_mask(len(r["target_ids"]), 0.15, 0, 0, 0)
    seq, positions, _ = mixed_example(r["prompt_ids"], r["target_ids"], r["draft_ids"], r["p_acc"], mask)
    hidden = draft_features(draft, [seq], [positions])[0]
    expect = torch.sigmoid(AcceptanceHead.from_pretrained(tmp_path / "h")(hidden)).squeeze(-1).detach().double().numpy()
    np.testing.assert_allclose(preds[0][(~mask).numpy()], expect, rtol=1e-5)


def test_cli_bad_input_is_named(potential_dataset, tmp_path):
    with pytest.raises(ValueError, match="exactly one of"):
        cli.run(str(potential_dataset), cli.PotentialConfig(quiet=True))
    with pytest.raises(ValueError, match="no split 'dev'"):
        cli.run(str(potential_dataset), cli.PotentialConfig(split="dev", cost_ratio=0.1, quiet=True))
    with pytest.raises(FileNotFoundError, match="nope.json"):
        cli.run(str(potential_dataset), cli.PotentialConfig(quiet=True), costs_file=str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"t_draft": 0.1}))
    with pytest.raises(ValueError, match="t_draft and t_target"):
        cli.run(str(potential_dataset), cli.PotentialConfig(quiet=True), costs_file=str(bad))


def test_cli_passes_its_settings_as_one_potential_config(monkeypatch):
    """main builds run's PotentialConfig from the command line; paths stay run's own arguments."""
    seen = {}
    monkeypatch.setattr(cli, "run", lambda data, config, **kw: seen.update(data=data, config=config, **kw))
    cli.main(["DATA", "--split", "dev", "--cost-ratio", "0.2", "--head", "h1", "--head", "h2", "--draft", "D",
              "--head-context", "target", "--seeds", "3", "--max-k", "6", "--thresholds", "0.4", "0.6",
              "--svip-thresholds", "0.5", "--limit", "7", "--out", "O"])
    assert seen == {"data": "DATA", "costs_file": None, "heads": ["h1", "h2"], "draft": "D", "out": "O",
                    "config": cli.PotentialConfig(split="dev", cost_ratio=0.2, seeds=3, max_k=6, thresholds=(0.4, 0.6),
                                                  svip_thresholds=(0.5,), limit=7, head_context="target")}


@pytest.mark.parametrize("below, shown", [(10.0, True), (-10.0, False)])
def test_the_verdict_line_points_to_the_whatif_grid_only_below_its_margin(potential_dataset, tmp_path, monkeypatch,
                                                                          below, shown):
    monkeypatch.setattr(cli, "WHATIF_BELOW", below)
    cli.run(str(potential_dataset), cli.PotentialConfig(split="test", cost_ratio=0.1, seeds=1, max_k=3,
                                                        thresholds=(0.5,), svip_thresholds=(0.3,), n_boot=10,
                                                        quiet=True), out=str(tmp_path / "p"))
    md = (tmp_path / "p" / "potential.md").read_text()
    command = f"python -m infer.potential {potential_dataset} --split test --cost-ratio 0.100 --whatif-gammas"
    assert ("verdict:" in md and command in md) == shown


def test_greedy_oracle_hand_made():
    target = [5, 6, 7, 8, 9, 10]
    draft = [5, 6, 0, 8, 0, 10]  # disagreements at positions 2 and 4
    s = greedy_oracle(target, draft)
    # rounds: draft 5 6, target emits 7 | draft 8, target emits 9 | target emits 10 (last token)
    assert (s.accept_lengths, s.candidate_lengths) == ([2, 1, 0], [2, 1, 0])
    assert (s.n_generated, s.n_target_calls, s.n_draft_calls, s.n_discarded) == (6, 3, 3, 0)
    assert greedy_oracle([1, 2, 3], [1, 2, 3]).accept_lengths == [2]
    assert greedy_oracle([1, 2, 3], [0, 0, 0]).n_target_calls == 3
    with pytest.raises(ValueError, match="draft predictions"):
        greedy_oracle([1, 2], [1])
