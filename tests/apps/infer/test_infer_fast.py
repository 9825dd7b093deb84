"""infer's ``fast`` key: checked before any model loads, passed to the methods that decode with our
engine (ignored by hf_assisted and the oracle), recorded in every row, in the file tag only when
set, and a table of its own in the report (fast methods against fast target-only); batches too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import infer.app as app
from infer.report import build_report
from infer.results import read_rows
from tests.helpers.paths import REPO

ROOT = REPO


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("infer", overrides=list(overrides))


@pytest.fixture(scope="module")
def base(tiny_pair, tmp_path_factory):
    prompts = tmp_path_factory.mktemp("infer_fast") / "prompts.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n'
                       '{"id": "math", "prompt": "What is 12 times 7?"}\n')
    return [f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "prompts=jsonl",
            f"prompts.path={prompts}", "max_new_tokens=6", "warmup_tokens=2", "progress=false", "sampling=greedy"]


def test_fast_is_checked_before_loading_and_names_the_file_only_when_set(base, tmp_path, monkeypatch):
    monkeypatch.setattr(app, "load_pair", lambda *a, **k: pytest.fail("a model was loaded before the checks"))
    app._LOADED.clear()
    cfg = [*base, f"out={tmp_path}"]
    eager, fast = (app.prepare(make_cfg(*cfg, "method=fixed_k", "method.k=2", *extra))
                   for extra in ([], ["fast=static"]))
    assert eager.path.name == "k2__greedy__s0.jsonl" and eager.fast is None and eager.run_keys["fast"] is None
    assert fast.path.name == "k2_fast-static__greedy__s0.jsonl" and fast.run_keys["fast"] == "static"
    with pytest.raises(ValueError, match="infer: fast must be one of None, 'static', 'compile', 'graphs', "
                                         "'compile-graphs', got 'turbo'"):
        app.prepare(make_cfg(*cfg, "method=fixed_k", "fast=turbo"))
    with pytest.raises(ValueError, match="infer: fast='graphs' needs CUDA; the models are on cpu"):
        app.prepare(make_cfg(*cfg, "method=fixed_k", "pair.device=cpu", "fast=graphs"))
    with pytest.raises(ValueError, match="infer: fast='compile-graphs' needs CUDA; the models are on cpu"):
        app.prepare(make_cfg(*cfg, "method=fixed_k", "pair.device=cpu", "fast=compile-graphs"))
    with pytest.raises(ValueError, match="PEARLDecoder: fast='compile' is not supported"):
        app.prepare(make_cfg(*cfg, "method=pearl", "method.gamma=2", "fast=compile"))
    batched = app.prepare(make_cfg(*cfg, "method=fixed_k", "fast=static", "batch_size=2"))
    assert batched.fast == "static" and batched.batch_size == 2
    for method in ("hf_assisted", "oracle"):  # they ignore it: their own generate / untimed counts
        job = app.prepare(make_cfg(*cfg, f"method={method}", "fast=compile"))
        assert job.fast is None and "_fast" not in job.path.name
    assert app.prepare(make_cfg(*cfg, "method=pearl", "method.gamma=2", "fast=static")).fast == "static"


def test_fast_rows_equal_eager_ones_and_get_their_own_table(base, tmp_path):
    """target-only and fixed K, eager and on the static cache: the same greedy outputs, every row
    says its ``fast``, and the report compares fast methods with fast target-only."""
    out = tmp_path / "results"
    rows = {}
    for fast in ("null", "static"):
        for name, method in (("target_only", ["method=target_only"]), ("fixed_k", ["method=fixed_k", "method.k=3"]),
                             ("sequoia", ["method=sequoia", "method.tree=[-1,-1,0]"])):
            summary = app.run(make_cfg(*base, *method, f"fast={fast}", f"out={out}/{name}"))
            rows[(name, fast)] = read_rows(Path(summary["path"]))
    reference = {r["prompt_id"]: r["output_ids"] for r in rows[("target_only", "null")]}
    for (name, fast), rs in rows.items():
        assert {r["fast"] for r in rs} == {None if fast == "null" else fast}, (name, fast)
        # eager: the models' hooks; fast: around the static runners' steps (infer.meters.FeedMeters)
        assert all(0 < r["forward_time_s"] < r["wall_time_s"] for r in rs), (name, fast)
        assert {r["prompt_id"]: r["output_ids"] for r in rs} == reference, (name, fast)
    report = build_report(out, tmp_path / "report")
    groups = {g["fast"]: g for g in report["groups"]}
    assert set(groups) == {None, "static"}
    assert {e["method"] for e in groups["static"]["entries"]} == {"target_only", "fixed_k", "sequoia"}
    assert all(e["speedup"] is not None for e in groups["static"]["entries"])  # against fast target-only
    assert all(0 < e["outside_forward_share"] < 1 for e in groups["static"]["entries"])
    assert groups["static"]["baseline"] == {"method": "target_only", "tag": "base", "fast": "static",
                                            "tokens_per_s": groups["static"]["entries"][0]["tokens_per_s"],
                                            "n_prompts": 2}
    assert "Speedups are over target-only on the same path: fast=static, 2 prompts" in report["text"]
    assert " / fast=static\n" in report["text"] and report["text"].count("## ") == 2


def test_fast_batches_equal_eager_ones(base, tmp_path):
    """batch_size=2 on the static batch runner: the same greedy outputs as eager batches."""
    outputs = {}
    for fast in ("null", "static"):
        summary = app.run(make_cfg(*base, "method=fixed_k", "method.k=2", "batch_size=2", f"fast={fast}",
                                   f"out={tmp_path}/{fast}"))
        rows = read_rows(Path(summary["path"]))
        assert {(r["fast"], r["batch_size"]) for r in rows} == {(None if fast == "null" else fast, 2)}
        outputs[fast] = {r["prompt_id"]: r["output_ids"] for r in rows}
    assert outputs["static"] == outputs["null"] and len(outputs["null"]) == 2


def test_sweep_runs_every_method_eager_and_fast_interleaved_in_one_process(base, tmp_path, monkeypatch):
    """infer.sweep 'fast=[null,static]' (make bench-fast): each method on both paths, a prompt's every
    run before the next prompt, one result file per path; hf_assisted (which ignores fast) once; a
    rerun resumes; a single infer run refuses a list."""
    from infer import sweep

    common = [*base, "interleave=true", "comparison.fixed_k.k=[2]", "~comparison.svip", "~comparison.specdecpp",
              "~comparison.oracle", "comparison.hf_assisted.mode=[constant]",
              "comparison.hf_assisted.num_assistant_tokens=2",
              f"out={tmp_path}/res/${{method.name}}"]
    calls = []
    real = app.make_row
    monkeypatch.setattr(app, "make_row", lambda job, decoded, *a: calls.append((decoded.prompt.id, job.path.name))
                        or real(job, decoded, *a))
    summaries = sweep.run(make_cfg(*common, "fast=[null,static]"))
    names = [Path(s["path"]).name for s in summaries]
    assert names == ["base__greedy__s0.jsonl", "base_fast-static__greedy__s0.jsonl", "k2__greedy__s0.jsonl",
                     "k2_fast-static__greedy__s0.jsonl", "constant_n2__greedy__s0.jsonl"]
    assert [name for _, name in calls[:5]] == names and len({p for p, _ in calls[:5]}) == 1  # interleaved
    rows = {name: read_rows(Path(s["path"])) for name, s in zip(names, summaries, strict=True)}
    for eager, fast in ((names[0], names[1]), (names[2], names[3])):  # float32: the same greedy tokens
        assert [r["output_ids"] for r in rows[eager]] == [r["output_ids"] for r in rows[fast]]
        assert {r["fast"] for r in rows[fast]} == {"static"} and {r["fast"] for r in rows[eager]} == {None}
    report = build_report(tmp_path / "res", tmp_path / "report")
    methods = {g["fast"]: sorted(e["method"] for e in g["entries"]) for g in report["groups"]}
    assert methods == {None: ["fixed_k", "hf_assisted", "target_only"], "static": ["fixed_k", "target_only"]}
    assert [s["new_rows"] for s in sweep.run(make_cfg(*common, "fast=[null,static]"))] == [0] * 5  # resumed
    with pytest.raises(ValueError, match=r"a list needs distinct fast paths"):
        sweep.run(make_cfg(*common, "fast=[static,static]"))
    with pytest.raises(ValueError, match=r"one run takes one fast path; python -m infer.sweep"):
        app.prepare(make_cfg(*base, "method=fixed_k", "fast=[null,static]", f"out={tmp_path}/one"))


def test_costs_cli_times_the_fast_path(tiny_pair, tmp_path, capsys):
    """python -m infer.costs --fast static: the width curves on the static runner, recorded as such."""
    from infer import costs as cli
    from specdecpp.analysis.costmodel import load_costs
    from tests.helpers.tiny import tiny_lm

    # a target of 6 layers of width 64 over tiny_pair's 1-layer draft: t_draft < t_target (load_costs's check)
    # holds on a loaded machine too (the 2-layer tiny target's median fell below the draft's under load)
    target = tmp_path / "target"
    model = tiny_lm(tiny_pair.vocab, 64, 6, seed=13, scale=0.15)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        setattr(model.config, key, getattr(tiny_pair.tokenizer, key))
    model.save_pretrained(target)
    tiny_pair.tokenizer.save_pretrained(target)
    path = tmp_path / "costs.json"
    cli.main(["--draft", tiny_pair.draft, "--target", str(target), "--sources", "bundled", "--limit", "1",
              "--max-new-tokens", "4", "--timing-steps", "9", "--dtype", "float32", "--fast", "static",
              "--costs-out", str(path)])
    assert "fast path: static" in capsys.readouterr().out
    costs = load_costs(path)
    assert costs.meta["fast"] == "static" and sorted(costs.target_by_width) == list(range(1, 9))
    assert all(t > 0 for t in costs.target_by_width.values())


def test_costs_cli_times_batches_on_the_fast_path(tiny_pair, tmp_path, capsys, monkeypatch):
    """--fast with --batch-sizes: the batched curves come from the static batch runner (every
    timed batched forward goes through it), B = 1 and each size given, widths up to 8."""
    from infer import costs as cli
    from specdecpp.fast.batch_runner import StaticBatchRunner

    fed = []
    feed = StaticBatchRunner.feed
    monkeypatch.setattr(StaticBatchRunner, "feed", lambda self, *a, **k: fed.append(self.rows) or feed(self, *a, **k))
    path = tmp_path / "costs.json"
    cli.main(["--draft", tiny_pair.draft, "--target", tiny_pair.target, "--sources", "bundled", "--limit", "1",
              "--max-new-tokens", "4", "--timing-steps", "2", "--dtype", "float32", "--fast", "static",
              "--batch-sizes", "3", "--costs-out", str(path)])
    # the file as written (load_costs also wants t_draft < t_target, which two timing steps of a tiny pair on a
    # loaded machine need not give: the draft's 1-layer step has measured slower than the 2-layer target's)
    costs = json.loads(path.read_text())
    assert costs["fast"] == "static"
    assert sorted(costs["draft_by_batch"]) == ["1", "3"] and sorted(costs["target_by_batch"]) == ["1", "3"]
    assert sorted(int(n) for n in costs["target_by_batch"]["3"]) == list(range(1, 9))
    assert all(t > 0 for by_n in costs["target_by_batch"].values() for t in by_n.values())
    assert {1, 3} <= set(fed)  # rows per batched forward: the static batch runner timed both sizes


@pytest.mark.parametrize("value, want", [("tuned", "tuned"), ("plain", {}),
                                         ("{max_autotune: true}", {"max_autotune": True})])
def test_compile_options_from_the_config(value, want):
    """infer's ``compile_options`` sets the inductor options fast=compile compiles with on a CPU
    (the suite's own plain default restored after); a bad value names the key."""
    from specdecpp.fast.compiling import COMPILE_OPTIONS, TUNED_COMPILE_OPTIONS

    before = dict(COMPILE_OPTIONS["cpu"])
    try:
        app.set_process_options(make_cfg(f"compile_options={value}"))
        assert COMPILE_OPTIONS["cpu"] == (TUNED_COMPILE_OPTIONS["cpu"] if want == "tuned" else want)
        with pytest.raises(ValueError, match="compile_options must be 'tuned', 'plain' or a dict"):
            app.set_process_options(make_cfg("compile_options=fastest"))
    finally:
        COMPILE_OPTIONS["cpu"] = before


def test_capture_rounds_is_checked_named_in_the_tag_and_ignored_where_no_round_is_captured(base, tmp_path,
                                                                                            monkeypatch):
    """``capture_rounds``: true (the default: nothing recorded, the file tag as before), false and fused
    where a stop policy decodes on a graph backend (recorded in the rows' keys, ``_per-forward`` /
    ``_fused`` in the file tag); a bad value refused, naming it; elsewhere said and ignored."""
    from tests.helpers import graph_tape

    graph_tape.install(monkeypatch)  # graphs on a CPU (the fake capture)
    monkeypatch.setattr(app, "load_pair", lambda *a, **k: pytest.fail("a model was loaded before the checks"))
    cfg = [*base, f"out={tmp_path}", "pair.device=cpu", "method=fixed_k", "method.k=2"]
    plain, per_forward, fused = (app.prepare(make_cfg(*cfg, *extra)) for extra in (
        ["fast=graphs"], ["fast=graphs", "capture_rounds=false"], ["fast=compile-graphs", "capture_rounds=fused"]))
    assert plain.path.name == "k2_fast-graphs__greedy__s0.jsonl" and "capture_rounds" not in plain.run_keys
    assert plain.capture_rounds is True
    assert per_forward.path.name == "k2_fast-graphs_per-forward__greedy__s0.jsonl"
    assert per_forward.capture_rounds is False and per_forward.run_keys["capture_rounds"] is False
    assert fused.path.name == "k2_fast-compile-graphs_fused__greedy__s0.jsonl"
    assert fused.capture_rounds == "fused" and fused.run_keys["capture_rounds"] == "fused"
    for bad in ("yes", "1", "0.5"):
        with pytest.raises(ValueError, match=r"capture_rounds must be true, false or fused, got"):
            app.prepare(make_cfg(*cfg, "fast=graphs", f"capture_rounds={bad}"))
    for extra in (["fast=static", "capture_rounds=false"],
                  ["fast=graphs", "capture_rounds=fused"],  # fused: compile-graphs
                  ["fast=graphs", "capture_rounds=false", "batch_size=2"], ["capture_rounds=fused"]):
        job = app.prepare(make_cfg(*cfg, *extra))
        assert job.capture_rounds is True and "capture_rounds" not in job.run_keys, extra
        assert "_fused" not in job.path.name and "_per-forward" not in job.path.name, extra
    seq = app.prepare(make_cfg(*base, f"out={tmp_path}", "pair.device=cpu", "method=sequoia", "method.tree=[-1,-1,0]",
                               "fast=graphs", "capture_rounds=false"))
    assert seq.capture_rounds is True  # a tree's rounds are not captured whole


def test_rounds_per_forward_rows_equal_captured_ones_and_get_their_own_tag(base, tmp_path, monkeypatch):
    """fast=graphs (the CPU's fake capture): fixed K with rounds captured and with each forward
    replayed (capture_rounds=false) give the same greedy outputs; the captured run replays rounds and
    the other none; the report shows both in the graphs table, the second as ``k3+per-forward``, with
    plain target-only as the baseline of both."""
    from tests.helpers import graph_tape

    graph_tape.install(monkeypatch)
    out = tmp_path / "results"
    rows = {}
    for name, extra in (("target_only", ["method=target_only"]), ("fixed_k", ["method=fixed_k", "method.k=3"]),
                        ("fixed_k_pf", ["method=fixed_k", "method.k=3", "capture_rounds=false"])):
        summary = app.run(make_cfg(*base, "pair.device=cpu", "fast=graphs", *extra, f"out={out}/{name}"))
        rows[name] = read_rows(Path(summary["path"]))
    assert [r["output_ids"] for r in rows["fixed_k"]] == [r["output_ids"] for r in rows["fixed_k_pf"]]
    assert all(r["replayed_rounds"] > 0 for r in rows["fixed_k"]), [r.get("replayed_rounds") for r in rows["fixed_k"]]
    assert all(r["replayed_rounds"] == 0 for r in rows["fixed_k_pf"])
    assert {r.get("capture_rounds", True) for r in rows["fixed_k_pf"]} == {False}
    report = build_report(out, tmp_path / "report")
    (group,) = report["groups"]
    assert sorted(e["tag"] for e in group["entries"]) == ["base", "k3", "k3+per-forward"]
    assert group["baseline"]["tag"] == "base" and all(e["speedup"] is not None for e in group["entries"])
    assert "k3+per-forward" in report["text"]
