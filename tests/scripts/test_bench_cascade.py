"""make bench-cascade: its comparison parses into the intended runs with one result file each, and
scripts/cascade_tables.py tabulates a report's summary."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_bench_cascade_runs_every_rule_over_alphas_and_the_head_comparison_in_distinct_files():
    from infer.methods import resolve_method
    from infer.sweep import expand_comparison
    from specdecpp.core.sampling import SamplingConfig

    dry = subprocess.run(["make", "-n", "bench-cascade", f"PYTHON={sys.executable}"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    sweep = next(line for line in dry.replace("\\\n", " ").splitlines() if "infer.sweep" in line)
    args = shlex.split(sweep.split("do", 1)[1].split("|| exit")[0])
    overrides = [a.replace("$set", "humaneval") for a in args[3:] if not a.startswith("out=")]
    assert "interleave=true" in overrides and "prompts.limit=8" in overrides and "max_new_tokens=64" in overrides
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("infer", overrides=overrides)
    methods = expand_comparison(cfg.comparison)
    cascades = [m for m in methods if m.name == "cascade"]
    grid = {(m.rule, float(m.alpha)) for m in cascades if m.stop == "fixed_k" and m.k == 3}
    for rule in ("chow", "diff", "opt", "token_v3"):
        assert len({a for r, a in grid if r == rule}) >= 4, rule
    assert {m.k for m in cascades if (m.rule, m.alpha, m.stop) == ("opt", 0.2, "fixed_k")} == {1, 2, 3, 4}
    heads = {str(m.head) for m in cascades if m.stop == "specdecpp"}
    assert heads == {"heads/cascade/opt_a0.2_next_wrej1_d1", "demo/heads/next_wrej1_d1"}
    assert [m.name for m in methods if m.name != "cascade"] == ["target_only", "fixed_k", "fixed_k"]
    # one result file per run: the tags of the runs that need no head are distinct
    sampling = SamplingConfig.from_mapping(cfg.sampling)
    tags = [resolve_method(m, "draft", sampling).tag for m in methods if m.get("stop") != "specdecpp"]
    assert len(tags) == len(set(tags))


def test_cascade_tables_from_a_summary(tmp_path):
    import cascade_tables

    head = tmp_path / "h_opt"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"training": {"dataset_meta": {"labels": {"cascade": {
        "rule": "opt", "alpha": 0.2}}}}}))
    exact_head = tmp_path / "h_exact"
    exact_head.mkdir()
    (exact_head / "config.json").write_text(json.dumps({"training": {"dataset_meta": {}}}))

    def entry(method, settings, tps, lossy=False, score=0.5):
        return {"method": method, "tag": "t", "settings": settings, "tokens_per_s": tps, "speedup": tps / 10,
                "speedup_ci95": [tps / 11, tps / 9], "verification_rate": 0.5, "mean_accept_length": 1.5,
                "target_logprob_per_token": -2.0, "greedy_match": 0.5, "lossy": lossy, "task": "humaneval",
                "task_score": score, "task_score_ci95": [0.0, 1.0]}

    def cascade(rule, alpha, stop="fixed_k", **policy):
        return {"rule": rule, "alpha": alpha, "stop": stop, "policy": policy,
                **({"head": str(policy.pop("head"))} if "head" in policy else {})}

    entries = [entry("target_only", {}, 10.0), entry("fixed_k", {"k": 3}, 12.0),
               entry("cascade", cascade("opt", 0.2, k=3), 20.0, True),
               entry("cascade", cascade("opt", 0.2, k=2), 18.0, True),
               entry("cascade", cascade("diff", 0.1, k=3), 25.0, True, 0.0),
               entry("cascade", cascade("opt", 0.2, "specdecpp", head=head, threshold=0.4), 21.0, True),
               entry("cascade", cascade("opt", 0.2, "specdecpp", head=exact_head, threshold=0.4), 19.0, True)]
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps([{"prompts": "humaneval", "sampling": "T=1", "device": "cpu", "pair": "demo",
                                    "entries": entries}]))
    out = tmp_path / "tables.md"
    cascade_tables.main([str(summary), "--out", str(out)])
    text = out.read_text()
    frontier, under = text.split("Stop policies under the cascade opt alpha=0.2")
    assert "| HumanEval pass@1 [95% CI]" in frontier
    assert "| diff alpha=0.1, K=3 LOSSY | 25.00 | 2.50 [2.27, 2.78] |" in frontier and "K=2" not in frontier
    assert "| target-only (exact) | 10.00 | 1.00 |" in frontier and "| 0.50 [0.00, 1.00] |" in frontier
    assert "h_opt (opt alpha=0.2 labels) h=0.4" in under and "h_exact (exact labels) h=0.4" in under
    assert "opt alpha=0.2, K=2" in under and "diff" not in under
    with pytest.raises(SystemExit):
        cascade_tables.main([str(tmp_path / "missing.json")])
