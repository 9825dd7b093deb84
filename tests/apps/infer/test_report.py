"""infer.report and infer.summary on synthetic rows: the Eq. 2.1 regression and its prediction,
intervals, width costs and the fit warning, batched speedup intervals, each method paired with the
fastest fixed K and SVIP. (The report on a real tiny run: tests/apps/infer/test_infer.py.)"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from infer.report import build_report
from specdecpp.analysis.costmodel import Costs, predicted_latency_per_token, save_costs


def _row(method, tag, settings, pid, n_draft, n_target, n, wall, timed=True):
    return {"method": method, "tag": tag, "settings": settings, "prompt_id": pid, "timed": timed,
            "pair": {"name": "syn", "draft": "d", "target": "t"}, "prompts": {"name": "p"}, "device": "cpu",
            "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0}, "n_generated": n, "n_draft": n_draft,
            "n_target": n_target, "n_discarded": n_draft + n_target - n, "accept_lengths": [1] * n_target,
            "candidate_lengths": [1] * n_target, "wall_time_s": wall if timed else None,
            "draft_time_s": 0.0 if timed else None, "target_time_s": wall if timed else None}


def test_report_regression_and_prediction_from_synthetic_rows(tmp_path):
    t_d, t_t = 0.01, 0.05
    rows = []
    for i in range(4):
        rows.append(_row("target_only", "base", {}, f"p{i}", 0, 20 + i, 20 + i, t_t * (20 + i)))
        for k in (2, 4):
            n_draft, n_target = k * (8 + i), 8 + i
            rows.append(_row("fixed_k", f"k{k}", {"k": k}, f"p{i}", n_draft, n_target, 20 + i,
                             t_d * n_draft + t_t * n_target))
        rows.append(_row("hf_assisted", "constant_n5", {"mode": "constant", "num_assistant_tokens": 5},
                         f"p{i}", 30, 6, 20 + i, 99.0))  # not our engine: not in the fit
        rows.append(_row("oracle", "oracle", {}, f"p{i}", 14 + i, 6, 20 + i, None, timed=False))
    res = tmp_path / "results" / "run.jsonl"
    res.parent.mkdir()
    res.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report(res.parent, tmp_path / "report")
    (group,) = report["groups"]
    assert group["fit"]["t_draft"] == pytest.approx(t_d) and group["fit"]["t_target"] == pytest.approx(t_t)
    assert group["fit"]["r2"] == pytest.approx(1.0) and group["fit"]["n_rows"] == 12
    entries = {e["tag"]: e for e in group["entries"]}
    for tag in ("base", "k2", "k4"):  # exact Eq. 2.1 walls: Eq. 2.3 predicts the measured throughput
        assert entries[tag]["measured_over_predicted"] == pytest.approx(1.0)
    k4 = [r for r in rows if r["tag"] == "k4"]
    n = sum(r["n_generated"] for r in k4)
    assert entries["k4"]["tokens_per_s"] == pytest.approx(n / sum(r["wall_time_s"] for r in k4))
    assert entries["k4"]["discard_rate"] == pytest.approx(sum(r["n_discarded"] for r in k4) / n)
    assert entries["k4"]["speedup"] == pytest.approx(entries["k4"]["tokens_per_s"] / entries["base"]["tokens_per_s"])
    oracle = entries["oracle"]
    assert oracle["tokens_per_s"] is None and oracle["verification_rate"] == pytest.approx(24 / 86)
    assert oracle["predicted_tokens_per_s"] == pytest.approx(
        1 / predicted_latency_per_token(t_d, t_t, 0.0, 24 / 86))
    text = report["report"].read_text()
    assert "t_draft = 10.000 ms, t_target = 50.000 ms, R^2 = 1.000" in text
    assert "| fixed_k | k4 | 4 |" in text
    for png in report["images"]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(report["summary"].read_text())[0]["fit"]["n_rows"] == 12


def test_report_intervals_width_costs_and_fit_warning(tmp_path):
    from infer.summary import paired_speedup_ci, width_latency

    rng = np.random.default_rng(0)
    rows = []
    for i in range(30):  # K=2 rounds: 10 rounds, 20 drafts, 25 tokens per prompt; noisy walls
        rows.append(_row("target_only", "base", {}, f"p{i}", 0, 25, 25, 25 * 0.05 * rng.uniform(0.5, 1.5)))
        rows[-1]["candidate_lengths"] = [0] * 25  # target-only rounds verify no candidate
        r = _row("fixed_k", "k2", {"k": 2}, f"p{i}", 20, 10, 25, 0.4 * rng.uniform(0.5, 1.5))
        r["candidate_lengths"] = [2] * 10
        rows.append(r)
    base = [r for r in rows if r["tag"] == "base"]
    k2 = [r for r in rows if r["tag"] == "k2"]
    lo, hi = paired_speedup_ci(k2, base)
    point = (sum(r["n_generated"] for r in k2) / sum(r["wall_time_s"] for r in k2)) / (
        sum(r["n_generated"] for r in base) / sum(r["wall_time_s"] for r in base))
    assert lo < point < hi and hi - lo > 0.05
    assert paired_speedup_ci(base, base) == pytest.approx((1.0, 1.0))  # a method against itself
    assert paired_speedup_ci(k2[:1], base[:1]) is None  # one prompt: no interval
    # t_target(n): 1 -> 50 ms, 3 -> 80 ms; per prompt 20 drafts x 10 ms + 10 verifications of 3 tokens
    costs = Costs(0.01, 0.05, {1: 0.05, 2: 0.07, 4: 0.09})
    assert width_latency(k2, costs) == pytest.approx((20 * 0.01 + 10 * 0.08) / 25)
    assert width_latency(base, costs) == pytest.approx(0.05)
    path = save_costs(costs, tmp_path / "costs.json")
    res = tmp_path / "results" / "run.jsonl"
    res.parent.mkdir()
    res.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report(res.parent, tmp_path / "report", costs=path)
    (group,) = report["groups"]
    entries = {e["tag"]: e for e in group["entries"]}
    assert entries["k2"]["speedup_width_predicted"] == pytest.approx(0.05 / ((20 * 0.01 + 10 * 0.08) / 25))
    assert entries["k2"]["speedup_ci95"] == pytest.approx((lo, hi))
    # noisy walls: the fit's t_draft comes out negative, flagged and not used (the R^2 warning is moot;
    # tests/apps/infer/test_report_bad_input.py has it for a fit with positive costs)
    assert group["fit"]["r2"] < 0.9 and group["fit_problem"].startswith("t_draft = -7.071 ms is not positive")
    assert not group["fit_warning"] and all(e["predicted_tokens_per_s"] is None for e in group["entries"])
    text = report["report"].read_text()
    # 30 prompts: not marked
    assert "Flagged, not used: t_draft = -7.071 ms" in text and f"[{lo:.2f}, {hi:.2f}] |" in text
    assert entries["k2"]["speedup_ci_n"] == 30 and "†" not in text
    few = tmp_path / "few" / "run.jsonl"  # 6 prompts: the interval is marked, with the note under the table
    few.parent.mkdir()
    few.write_text("".join(json.dumps(r) + "\n" for r in rows[:12]))
    text = build_report(few.parent, tmp_path / "report_few")["text"]
    assert re.search(r"\| \[\d\.\d\d, \d\.\d\d\]† \|", text) and "† bootstrapped from fewer than 10 prompts" in text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"t_draft": 0.01, "t_target": 0.05}))  # no width curve: the column needs one
    with pytest.raises(ValueError, match=r"bad\.json.*target_by_width"):
        build_report(res.parent, tmp_path / "r2", costs=bad)
    bad.write_text(json.dumps({"t_draft": 0.01, "target_by_width": {"1": 0.05}}))
    with pytest.raises(ValueError, match=r"bad\.json.*t_draft and t_target"):
        build_report(res.parent, tmp_path / "r2", costs=bad)


def test_batched_speedup_interval_is_over_calls():
    """Batched rows share their call's wall time: the paired interval resamples calls (the same
    calls for both methods), each call's tokens summed over its rows."""
    from infer.summary import paired_speedup_ci
    from specdecpp.analysis.stats import paired_ratio_interval

    def rows(tokens_walls):
        return [{"timed": True, "prompt_id": f"{c}-{j}", "batch_id": f"call{c}", "batch_wall_time_s": wall,
                 "n_generated": t} for c, (ts, wall) in enumerate(tokens_walls) for j, t in enumerate(ts)]

    mine = [([5, 7], 1.0), ([6, 6], 1.5), ([9, 2], 0.8), ([4, 4], 1.1)]
    base = [([6, 6], 1.4), ([6, 6], 1.6), ([6, 5], 1.2), ([4, 4], 1.3)]
    got = paired_speedup_ci(rows(mine), rows(base))
    cols = np.array([[sum(a), wa, sum(b), wb] for (a, wa), (b, wb) in zip(mine, base, strict=True)], dtype=float).T
    assert got == pytest.approx(paired_ratio_interval(*cols, n_resamples=1000, seed=0, level=0.95))
    assert paired_speedup_ci(rows(mine[:1]), rows(base[:1])) is None  # one call: no interval


def test_report_pairs_each_method_with_the_fastest_fixed_k_and_svip(tmp_path):
    """The 'against the best baselines' lines: ratio over the fastest fixed K and SVIP setting,
    recomputed here from the rows, with the paired interval over prompts and a verdict."""
    from infer.summary import paired_speedup_ci

    rng = np.random.default_rng(1)
    rows, svip = [], {"threshold": 0.5, "c": 0.15, "max_candidates": 40}
    for i in range(30):
        noise = rng.uniform(0.9, 1.1)  # a prompt's load, shared by every method (paired)
        rows.append(_row("target_only", "base", {}, f"p{i}", 0, 25, 25, 1.00 * noise))
        rows.append(_row("fixed_k", "k1", {"k": 1}, f"p{i}", 14, 12, 25, 0.80 * noise * rng.uniform(0.99, 1.01)))
        rows.append(_row("fixed_k", "k2", {"k": 2}, f"p{i}", 20, 10, 25, 0.90 * noise))
        rows.append(_row("svip", "h0.5", svip, f"p{i}", 14, 12, 25, 0.78 * noise * rng.uniform(0.99, 1.01)))
        rows.append(_row("specdecpp", "fast", {"threshold": 0.5}, f"p{i}", 14, 12, 25,
                         0.70 * noise * rng.uniform(0.99, 1.01)))
        rows.append(_row("specdecpp", "slow", {"threshold": 0.9}, f"p{i}", 14, 12, 25, 0.95 * noise))
    res = tmp_path / "results" / "run.jsonl"
    res.parent.mkdir()
    res.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report(res.parent, tmp_path / "report")
    entries = {e["tag"]: e for e in report["groups"][0]["entries"]}
    by_tag = {t: [r for r in rows if r["tag"] == t] for t in entries}

    def tps(tag):
        return sum(r["n_generated"] for r in by_tag[tag]) / sum(r["wall_time_s"] for r in by_tag[tag])

    fast = entries["fast"]["vs_best"]
    assert fast["fixed_k"]["tag"] == "k1" and fast["svip"]["tag"] == "h0.5"  # the fastest of each
    assert fast["fixed_k"]["ratio"] == pytest.approx(tps("fast") / tps("k1"))
    assert fast["fixed_k"]["ci95"] == pytest.approx(paired_speedup_ci(by_tag["fast"], by_tag["k1"]))
    assert fast["fixed_k"]["ci95"][0] > 1 and entries["slow"]["vs_best"]["svip"]["ci95"][1] < 1
    assert "fixed_k" not in entries["k1"]["vs_best"] and "svip" in entries["k1"]["vs_best"]  # not against itself
    assert entries["base"]["vs_best"] == {}
    text = report["report"].read_text()
    assert f"- specdecpp fast: {tps('fast') / tps('k1'):.3f}x" in text and "over fixed_k k1 (faster)" in text
    assert "over svip h0.5 (slower)" in text


def test_fast_rows_are_compared_with_fast_target_only_and_priced_with_fast_costs(tmp_path, capsys):
    """Rows of one prompt set, eager and fast=compile: each table's speedups are over its own
    target-only (the report says which), and Eq. 2.3 with t_target(n) uses the costs file measured
    on the table's own path; recomputed here from the rows and the two synthetic cost curves."""
    from infer import report as cli
    from infer.summary import paired_speedup_ci

    eager = Costs(0.006, 0.060, {1: 0.060, 2: 0.066, 4: 0.070})
    fast = Costs(0.004, 0.040, {1: 0.040, 2: 0.041, 4: 0.044}, {"fast": "compile"})

    def width_walls(costs, n_draft, widths):  # Eq. 2.1 with t_target(n) per round
        return n_draft * costs.t_draft + sum(costs.target_cost(w) for w in widths)

    rows = []
    for i in range(4):
        n = 24 + i
        for backend, costs, slower in ((None, eager, 1.0), ("compile", fast, 1.1)):  # fast: 10% off its model
            base = _row("target_only", "base", {}, f"p{i}", 0, n, n, slower * n * costs.target_cost(1))
            k2 = _row("fixed_k", "k2", {"k": 2}, f"p{i}", 20, 10, n, slower * width_walls(costs, 20, [3] * 10))
            base["candidate_lengths"], k2["candidate_lengths"] = [0] * n, [2] * 10
            rows += [{**r, "fast": backend, "machine": "Test CPU, 2 cores"} for r in (base, k2)]
        rows.append({**_row("hf_assisted", "constant_n2", {"mode": "constant"}, f"p{i}", 20, 10, n, 1.0),
                     "fast": None, "machine": "Test CPU, 2 cores"})  # ignores fast: compared with eager target-only
    res = tmp_path / "results" / "run.jsonl"
    res.parent.mkdir()
    res.write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = [save_costs(eager, tmp_path / "costs.json"), save_costs(fast, tmp_path / "costs_fast-compile.json")]
    report = build_report(res.parent, tmp_path / "report", costs=paths)
    groups = {g["fast"]: g for g in report["groups"]}
    assert set(groups) == {None, "compile"}
    for backend, costs in ((None, eager), ("compile", fast)):
        group = groups[backend]
        assert group["baseline"]["fast"] == backend and group["baseline"]["tag"] == "base"
        assert group["costs"]["fast"] == backend and group["costs"]["file"] == str(paths[backend is not None])
        mine = {t: [r for r in rows if r["tag"] == t and r["fast"] == backend] for t in ("base", "k2")}

        def tps(tag, mine=mine):
            return sum(r["n_generated"] for r in mine[tag]) / sum(r["wall_time_s"] for r in mine[tag])

        entries = {e["tag"]: e for e in group["entries"]}
        assert entries["k2"]["speedup"] == pytest.approx(tps("k2") / tps("base"))
        n = sum(r["n_generated"] for r in mine["k2"])
        predicted = costs.t_target / ((4 * 20 * costs.t_draft + 40 * costs.target_cost(3)) / n)
        assert entries["k2"]["speedup_width_predicted"] == pytest.approx(predicted)
    assert {e["method"] for e in groups[None]["entries"]} == {"target_only", "fixed_k", "hf_assisted"}
    for e in groups["compile"]["entries"]:  # each fast method over its own eager run, paired over prompts
        mine = [r for r in rows if r["tag"] == e["tag"] and r["fast"] == "compile"]
        theirs = [r for r in rows if r["tag"] == e["tag"] and r["fast"] is None]
        ratio = (sum(r["n_generated"] for r in mine) / sum(r["wall_time_s"] for r in mine)) / (
            sum(r["n_generated"] for r in theirs) / sum(r["wall_time_s"] for r in theirs))
        assert e["vs_eager"]["ratio"] == pytest.approx(ratio) and e["vs_eager"]["ci_n"] == 4
        assert e["vs_eager"]["ci95"] == pytest.approx(paired_speedup_ci(mine, theirs))
    assert all("vs_eager" not in e for e in groups[None]["entries"])
    assert groups["compile"]["entries"][1]["speedup_width_predicted"] != pytest.approx(
        groups[None]["entries"][1]["speedup_width_predicted"])  # the two paths' costs differ
    text = report["text"]
    fast_tps = groups["compile"]["baseline"]["tokens_per_s"]
    assert f"Speedups are over target-only on the same path: fast=compile, 4 prompts, {fast_tps:.2f} tokens/s." in text
    assert "Speedups are over target-only on the same path: eager (fast=null), 4 prompts" in text
    assert f"costs measured fast=compile (`{paths[1]}`; t_draft 4.00 ms, t_target 40.00 ms)" in text
    assert text.count("Machine: Test CPU, 2 cores.") == 2
    k2 = groups["compile"]["entries"][1]["vs_eager"]
    assert "Fast over eager, each method on fast=compile against its own eager run of the same prompts" in text
    assert f"fixed_k k2 {k2['ratio']:.2f}x [{k2['ci95'][0]:.2f}, {k2['ci95'][1]:.2f}]†" in text
    # eager costs only: the fast table gets no t_target(n) prediction and says which file is missing
    only_eager = build_report(res.parent, tmp_path / "report_eager", costs=paths[0])
    g = {g["fast"]: g for g in only_eager["groups"]}["compile"]
    assert g["costs"] is None and g["costs_missing"] and all(e["speedup_width_predicted"] is None for e in g["entries"])
    assert "none of the costs files was measured fast=compile" in only_eager["text"]
    assert "python -m infer.costs --fast compile --costs-out FILE" in only_eager["text"]
    with pytest.raises(ValueError, match="two costs files measured with fast=None"):
        build_report(res.parent, tmp_path / "r2", costs=[paths[0], paths[0]])
    # a fast table without fast target-only: no speedup, and the report says why
    no_base = tmp_path / "no_base" / "run.jsonl"
    no_base.parent.mkdir()
    no_base.write_text("".join(json.dumps(r) + "\n" for r in rows if not (r["fast"] and r["method"] == "target_only")))
    text = build_report(no_base.parent, tmp_path / "report_no_base")["text"]
    assert "No target-only rows on this path (fast=compile): no measured speedup" in text
    cli.main([str(res.parent), "--out", str(tmp_path / "cli"), "--costs", *map(str, paths)])  # --costs FILE FILE
    assert "costs measured fast=compile" in capsys.readouterr().out


def test_report_pairs_each_door_run_with_the_direct_decoder_of_the_same_policy(tmp_path):
    """hf_custom (the decoder through transformers' generate) against the direct run with the same
    policy and settings: the tokens/s ratio recomputed from the rows with its paired interval, and
    the prompts whose tokens are equal; a door run without its direct run says so."""
    from infer.summary import paired_speedup_ci

    rng = np.random.default_rng(2)
    rows, head = [], {"head": "heads/h", "head_sha": "abc", "threshold": 0.5}
    for i in range(12):
        noise = rng.uniform(0.9, 1.1)
        for method, tag, settings, wall in (("fixed_k", "k2", {"k": 2}, 0.8),
                                            ("hf_custom", "k2", {"stop": "fixed_k", "k": 2}, 0.8),
                                            ("specdecpp", "h_h0.5", head, 0.7),
                                            ("hf_custom", "h_h0.5", {"stop": "specdecpp", **head}, 0.6),
                                            ("hf_custom", "k3", {"stop": "fixed_k", "k": 3}, 0.8)):
            row = _row(method, tag, settings, f"p{i}", 14, 12, 25, wall * noise * rng.uniform(0.99, 1.01))
            row["output_ids"] = [i, 1] if (method, tag, i) != ("hf_custom", "k2", 3) else [i, 2]  # one prompt differs
            rows.append(row)
    res = tmp_path / "results" / "run.jsonl"
    res.parent.mkdir()
    res.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report(res.parent, tmp_path / "report")
    entries = {(e["method"], e["tag"]): e for e in report["groups"][0]["entries"]}
    by = {key: [r for r in rows if (r["method"], r["tag"]) == key] for key in entries}

    def tps(key):
        return sum(r["n_generated"] for r in by[key]) / sum(r["wall_time_s"] for r in by[key])

    k2 = entries["hf_custom", "k2"]["vs_direct"]
    assert k2["tag"] == "k2" and k2["ratio"] == pytest.approx(tps(("hf_custom", "k2")) / tps(("fixed_k", "k2")))
    assert k2["ci95"] == pytest.approx(paired_speedup_ci(by["hf_custom", "k2"], by["fixed_k", "k2"]))
    assert k2["ci95"][0] < 1 < k2["ci95"][1] and (k2["same_tokens"], k2["n_compared"]) == (11, 12)
    spp = entries["hf_custom", "h_h0.5"]["vs_direct"]
    assert spp["ci95"][0] > 1 and (spp["same_tokens"], spp["n_compared"]) == (12, 12)
    assert entries["hf_custom", "k3"]["vs_direct"] is None and "vs_direct" not in entries["fixed_k", "k2"]
    text = report["report"].read_text()
    assert f"- hf_custom k2: {k2['ratio']:.3f}x" in text and "over fixed_k k2 (not told apart); the same tokens on " \
        "11 of 12 prompts" in text
    assert "over specdecpp h_h0.5 (faster); the same tokens on 12 of 12 prompts" in text
    assert "- hf_custom k3: no direct fixed_k run with these settings" in text


def test_rows_naming_one_pair_by_other_paths_share_a_table(tmp_path, monkeypatch):
    """Rows whose pair names the same directories by a relative and by an absolute path (a resumed file or a
    method added later under another SPECDECPP_CACHE spelling) land in one group; another target does not."""
    from infer.summary import group_rows

    for role in ("draft", "target", "other"):
        (tmp_path / role).mkdir()
    monkeypatch.chdir(tmp_path)

    def row(method, draft, target):
        return {"method": method, "pair": {"name": "demo", "draft": draft, "target": target},
                "prompts": {"name": "p"}, "sampling": {"temperature": 0.0}}

    groups = group_rows([row("target_only", "draft", "target"),
                         row("fixed_k", str(tmp_path / "draft"), str(tmp_path / "target") + "/"),
                         row("svip", "draft", "other")])
    assert sorted(sorted(r["method"] for r in g) for g in groups.values()) == [["fixed_k", "target_only"], ["svip"]]
