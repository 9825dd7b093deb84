"""python -m infer.serve, the serving benchmark (docs/vllm.md, "Serving benchmark").

Its pure parts (method names, the rotated order, the prompts of a block, intervals, the summary, the
tables, the plot) and the inputs it refuses before any engine starts run without vLLM; the runs on a
tiny pair (tests/helpers/vllm.py) need vLLM's environment and skip elsewhere."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from infer import serve
from infer.serve_report import (
    FEW_MARK,
    Method,
    block_order,
    block_prompts,
    check_concurrency,
    greedy_mismatches,
    interval,
    overview,
    parse_method,
    parse_methods,
    plot,
    report,
    summarize,
    table,
)
from specdecpp.stopping.head import build_head
from specdecpp.vllm import config as vllm_config
from tests.helpers.paths import REPO
from tests.helpers.vllm import VLLM_ENV, VLLM_WARNINGS, save_pair

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed in this environment (make vllm-env; make test-vllm)")


# --- pure helpers ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "expected"), [
    ("target_only", Method("target_only", "target_only")),
    ("fixed_k3", Method("fixed_k3", "fixed_k", k=3)),
    ("fixed_k2+load_aware", Method("fixed_k2+load_aware", "fixed_k", k=2, load_aware=True)),
    ("ngram", Method("ngram", "ngram")),
    ("ngram_k5", Method("ngram_k5", "ngram", k=5)),
    ("svip", Method("svip", "svip")),
    ("svip:0.4+load_aware", Method("svip:0.4+load_aware", "svip", threshold=0.4, load_aware=True)),
    ("online:0.6", Method("online:0.6", "online", threshold=0.6)),
    ("head:demo/heads/next_wrej1_d1", Method("head:demo/heads/next_wrej1_d1", "head", head="demo/heads/next_wrej1_d1")),
    ("head:h@0.7+load_aware", Method("head:h@0.7+load_aware", "head", head="h", threshold=0.7, load_aware=True)),
])
def test_method_names_parse(name, expected):
    method = parse_method(name)
    assert method == expected
    assert method.ours == (expected.kind in ("svip", "online", "head") or expected.load_aware)


@pytest.mark.parametrize(("name", "match"), [
    ("fixed_k", "unknown method 'fixed_k'"), ("fixed_k0", "unknown method"), ("eagle", "unknown method 'eagle'"),
    ("svip:1.5", r"threshold must be in \[0, 1\]"), ("svip:x", "is not a number"), ("head:", "needs the head"),
    ("target_only+load_aware", "not to target_only"), ("ngram+load_aware", "not to ngram"), ("", "empty method"),
])
def test_bad_method_names_are_refused(name, match):
    with pytest.raises(ValueError, match=match):
        parse_method(name)


def test_a_method_list_needs_target_only_and_no_repeats():
    assert [m.name for m in parse_methods(["target_only", "svip"])] == ["target_only", "svip"]
    with pytest.raises(ValueError, match="must include target_only"):
        parse_methods(["fixed_k1", "svip"])
    with pytest.raises(ValueError, match=r"given twice: \['svip'\]"):
        parse_methods(["target_only", "svip", "svip"])
    with pytest.raises(ValueError, match="no methods given"):
        parse_methods([])


def test_concurrency_levels_are_checked():
    assert check_concurrency([1, 4, 16, 64]) == [1, 4, 16, 64]
    for bad, match in (([], "at least one level"), ([0, 2], "positive integers"), ([2, 2], "given twice")):
        with pytest.raises(ValueError, match=match):
            check_concurrency(bad)


def test_the_order_rotates_so_every_method_takes_every_position():
    names = ["a", "b", "c", "d"]
    orders = [block_order(names, r) for r in range(len(names))]
    assert orders[0] == names and orders[1] == ["b", "c", "d", "a"]
    for position in range(len(names)):
        assert sorted(o[position] for o in orders) == names
    assert block_order(names, 5) == orders[1]


def test_a_block_takes_consecutive_prompts_wrapping_around():
    assert block_prompts(10, 4, 0) == [0, 1, 2, 3]
    assert block_prompts(10, 4, 1) == [4, 5, 6, 7]
    assert block_prompts(10, 4, 2) == [8, 9, 0, 1]
    assert block_prompts(3, 5, 0) == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError):
        block_prompts(0, 1, 0)


def test_the_interval_over_repeats():
    assert interval([5.0]) is None
    assert interval([2.0, 4.0]) == (2.0, 4.0)  # medians of resamples of two values: 2, 3 or 4
    rng = np.random.default_rng(0)
    values = rng.normal(100, 5, 40)
    lo, hi = interval(values)
    assert lo < np.median(values) < hi and hi - lo < 10


def test_greedy_mismatches_name_the_requests_that_differ():
    outputs = {"target_only": [[1, 2], [3, 4], [5]], "good": [[1, 2], [3, 4], [5]], "bad": [[1, 2], [3, 9], [6]]}
    assert greedy_mismatches(outputs) == {"bad": [1, 2]}
    with pytest.raises(ValueError, match="2 outputs for 3 requests"):
        greedy_mismatches({"target_only": [[1], [2], [3]], "short": [[1], [2]]})


def test_engines_are_built_with_ngram_last():
    methods = parse_methods(["target_only", "ngram", "fixed_k2", "ngram_k2", "svip"])
    assert serve.build_order(methods) == ["target_only", "fixed_k2", "svip", "ngram", "ngram_k2"]


def test_memory_for_the_remaining_engines_is_checked():
    gib = 1 << 30
    serve.check_memory(2 * gib, 3, 8 * gib)  # 6 GiB + 2 GiB margin fit
    with pytest.raises(MemoryError, match=r"holding 4 more engines needs about 10.0 GiB .* 8.0 GiB available: "
                                          r"pass --one-engine-at-a-time"):
        serve.check_memory(2 * gib, 4, 8 * gib)
    serve.check_memory(None, 4, 8 * gib)  # nothing known: no check
    assert serve.mem_available() is None or serve.mem_available() > 0


def block(method, repeat, tps, concurrency=2, temperature=0.0, tpots=(0.01, 0.02), drafted=0, accepted=0):
    return {"temperature": temperature, "concurrency": concurrency, "repeat": repeat, "method": method,
            "output_tokens": 100, "wall_s": 100 / tps, "tokens_per_s": tps,
            "requests": [{"output_tokens": 50, "tpot_s": t} for t in tpots],
            "spec": {"num_drafts": drafted // 2, "num_draft_tokens": drafted, "num_accepted_tokens": accepted}}


def test_the_summary_medians_ratios_and_tpot():
    blocks = [block("target_only", 0, 100.0), block("target_only", 1, 50.0), block("target_only", 2, 80.0),
              block("svip", 0, 150.0, tpots=(0.01, 0.03), drafted=10, accepted=6),
              block("svip", 1, 100.0, tpots=(0.02, 0.04), drafted=10, accepted=4),
              block("svip", 2, 120.0, tpots=(0.05, 0.06), drafted=20, accepted=10)]
    base, svip = summarize(blocks)
    assert (base["method"], svip["method"]) == ("target_only", "svip")
    assert base["tokens_per_s"] == 80.0 and base["ratio"] == 1.0 and base["ratio_ci95"] is None
    assert svip["tokens_per_s"] == 120.0
    assert svip["ratio"] == pytest.approx(1.5)  # per-block ratios 1.5, 2.0, 1.5
    lo, hi = svip["ratio_ci95"]
    assert lo == pytest.approx(1.5) and hi == pytest.approx(2.0)
    assert svip["tpot_median_s"] == pytest.approx(np.median([0.01, 0.03, 0.02, 0.04, 0.05, 0.06]))
    assert svip["tpot_p90_s"] == pytest.approx(np.percentile([0.01, 0.03, 0.02, 0.04, 0.05, 0.06], 90))
    assert svip["acceptance"] == pytest.approx(20 / 40) and svip["accepted_per_draft"] == pytest.approx(20 / 20)
    # 300 output tokens of 6 requests (each one's first from the prefill), 20 accepted: 274 decode steps
    assert svip["drafted_per_step"] == pytest.approx(40 / 274)
    assert base["drafted_per_step"] is None
    assert svip["greedy_checked"] and not svip["greedy_mismatches"]
    assert base["acceptance"] is None


def test_the_overview_gives_each_methods_ratio_by_concurrency_and_marks_the_best():
    blocks = [block(m, r, tps, concurrency=c) for c in (1, 4) for r in range(2)
              for m, tps in (("target_only", 100.0 * c), ("svip", (110.0 if c == 1 else 90.0) * c))]
    text = overview(summarize(blocks), top_k=50)
    lines = text.splitlines()
    assert lines[0] == "### greedy (T=0): ratio to target-only"
    assert lines[2] == "| method | c=1 | c=4 |"
    (base,) = [line for line in lines if line.startswith("| target_only ")]
    (svip,) = [line for line in lines if line.startswith("| svip ")]
    assert base == "| target_only | 1 (100.0 tok/s) | **1 (400.0 tok/s)** |"  # the best at c=4
    assert svip.startswith("| svip | **1.10x [1.10, 1.10]") and "| 0.90x [0.90, 0.90]" in svip


def test_a_method_whose_greedy_output_differs_gets_no_figures():
    blocks = [block("target_only", r, 100.0) for r in range(2)] + [block("fixed_k2", r, 321.5) for r in range(2)] \
        + [block("svip", r, 123.4) for r in range(2)]
    summary = summarize(blocks, {(0.0, 2, "fixed_k2"): [(1, 0)]})
    text = table(summary)
    (row,) = [line for line in text.splitlines() if line.startswith("| fixed_k2 ")]
    assert "not reported" in row and "differs from target-only: repeat 1 request 0" in row and "321" not in row
    (row,) = [line for line in text.splitlines() if line.startswith("| svip ")]
    assert "123.4" in row and "= target-only" in row and "1.234x" in row and FEW_MARK in row


def fake_result(summary, plot_name=None):
    return {"machine": "a test CPU, 2 cores", "date": "2026-12-02", "command": "python -m infer.serve --x",
            "vllm_version": "0.32.0", "plot": plot_name, "notes": ["shared with a training job"], "summary": summary,
            "settings": {"draft": "d", "target": "t", "prompts": "bundled", "n_prompts": 70, "max_new_tokens": 32,
                         "repeats": 2, "top_k": 50, "engine": {"dtype": "float32"}}}


def test_the_report_names_machine_command_and_has_a_table_per_cell(tmp_path):
    blocks = [block(m, r, tps, concurrency=c, temperature=t) for t in (0.0, 1.0) for c in (1, 4) for r in range(2)
              for m, tps in (("target_only", 100.0 * c), ("svip", 110.0 * c))]
    summary = summarize(blocks)
    text = report(fake_result(summary, "serve.png"))
    assert "a test CPU, 2 cores" in text and "`python -m infer.serve --x`" in text
    assert "shared with a training job" in text
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## Overview", "## greedy (T=0), concurrency 1", "## greedy (T=0), concurrency 4",
                        "## T=1, top-k 50, concurrency 1", "## T=1, top-k 50, concurrency 4"]
    assert "![output tokens/s against concurrency](serve.png)" in text
    path = plot(summary, tmp_path / "img" / "serve.png", top_k=50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- inputs refused before any engine starts ------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("serve_pair"))


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if an engine starts; the version check passes where vLLM is not installed."""
    def start_engine(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(serve, "start_engine", start_engine)
    monkeypatch.setattr(vllm_config, "check_version", lambda: "0.32.0")


def args_for(pair, tmp_path, *extra):
    return ["--draft", str(pair[0]), "--target", str(pair[1]), "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), *extra]


@pytest.mark.parametrize(("extra", "match"), [
    (["--methods", "target_only", "fixed_k2", "medusa"], "unknown method 'medusa'"),
    (["--concurrency"], "--concurrency needs at least one level"),
    (["--methods", "fixed_k2"], "must include target_only"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--methods", "target_only", "ngram", "--one-engine-at-a-time"], "drop ngram or hold the engines at once"),
])
def test_bad_input_fails_before_any_engine(pair, tmp_path, no_engine, capsys, extra, match):
    with pytest.raises(SystemExit) as exc:
        serve.main(args_for(pair, tmp_path, *extra))
    assert exc.value.code == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_head_for_another_draft_fails_before_any_engine(pair, tmp_path, no_engine, capsys):
    head = tmp_path / "head32"
    build_head("next", 32, 1).save_pretrained(head)  # the draft's hidden size is 64
    with pytest.raises(SystemExit):
        serve.main(args_for(pair, tmp_path, "--methods", "target_only", f"head:{head}"))
    err = capsys.readouterr().err
    assert f"method 'head:{head}'" in err and "hidden_size 32" in err and "hidden_size 64" in err
    assert not (tmp_path / "out").exists()


def test_a_missing_model_directory_is_refused(tmp_path, no_engine, capsys):
    with pytest.raises(SystemExit):
        serve.main(["--draft", str(tmp_path / "nothing"), "--target", str(tmp_path / "nothing"),
                    "--out", str(tmp_path / "out")])
    assert "does not exist" in capsys.readouterr().err


# --- runs on the tiny pair (vLLM) ------------------------------------------------------------------

@pytest.fixture
def vllm_env(monkeypatch):
    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)


@needs_vllm
@VLLM_WARNINGS
def test_a_run_writes_every_measurement_and_greedy_outputs_match(pair, tmp_path):
    """``python -m infer.serve`` in a process of its own: after an n-gram engine no vLLM engine starts in
    the same process (serve.build_order), which would fail the tests that follow."""
    methods = ["target_only", "ngram", "fixed_k2", "svip:0.86"]  # ngram's engine is built last (build_order)
    run = subprocess.run([sys.executable, "-m", "infer.serve", *args_for(
        pair, tmp_path, "--concurrency", "1", "2", "--methods", *methods, "--repeats", "2", "--max-new-tokens", "12",
        "--ignore-eos", "--temperature", "0", "1")], cwd=REPO, env={**os.environ, **VLLM_ENV}, capture_output=True,
        text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| svip:0.86 |" in run.stdout  # the report is printed too
    out = tmp_path / "out"
    result = json.loads((out / "serve.json").read_text())
    assert result["settings"]["methods"] == methods and result["mismatches"] == []
    assert result["machine"] and result["command"].startswith("python -m infer.serve --draft")
    assert result["settings"]["speculative_configs"]["fixed_k2"]["method"] == "draft_model"
    blocks = result["blocks"]
    assert len(blocks) == 2 * 2 * 2 * len(methods)  # repeats x temperatures x concurrency x methods
    for b in blocks:
        assert len(b["requests"]) == b["concurrency"] == len(b["prompt_indices"])
        assert b["output_tokens"] == 12 * b["concurrency"]  # EOS ignored
        assert b["tokens_per_s"] == pytest.approx(b["output_tokens"] / b["wall_s"])
        assert all(r["tpot_s"] > 0 and 0 < r["ttft_s"] <= r["latency_s"] for r in b["requests"])
        if b["method"] in ("fixed_k2", "svip:0.86"):
            assert b["spec"]["num_draft_tokens"] > 0  # vLLM drafted, and told us per request
    # interleaved: within one (repeat, temperature, c) block, the order is the rotated method list
    for repeat in (0, 1):
        order = [b["method"] for b in blocks if (b["repeat"], b["temperature"], b["concurrency"]) == (repeat, 0.0, 2)]
        assert order == block_order(methods, repeat)
    summary = result["summary"]
    assert {(e["temperature"], e["concurrency"], e["method"]) for e in summary} == \
        {(t, c, m) for t in (0.0, 1.0) for c in (1, 2) for m in methods}
    assert all(e["greedy_checked"] for e in summary if e["temperature"] == 0 and e["method"] != "target_only")
    text = (out / "serve.md").read_text()
    # the overview and one table per (temperature, concurrency); svip:0.86 in each, the overview's by temperature
    assert text.count("\n## ") == 1 + 4 and text.count("| svip:0.86 |") == 4 + 2
    assert text.count("= target-only") == 2 * 3
    assert "not reported" not in text
    assert (out / "serve.png").read_bytes()[:4] == b"\x89PNG"


@needs_vllm
@VLLM_WARNINGS
def test_a_method_whose_greedy_output_differs_is_marked_and_fails_the_run(pair, tmp_path, vllm_env, monkeypatch):
    """The check itself: fixed_k2's tokens are altered on their way back, as a wrong decoder's would be (with
    one engine at a time: each method's engine built per repeat, the order rotated)."""
    original = serve.run_block

    def run_block(llm, prompts, params):
        record, tokens = original(llm, prompts, params)
        if llm.llm_engine.vllm_config.speculative_config is not None:
            tokens[-1] = tokens[-1][:-1] + [tokens[-1][-1] + 1]
        return record, tokens

    monkeypatch.setattr(serve, "run_block", run_block)
    code = serve.main(args_for(pair, tmp_path, "--concurrency", "2", "--methods", "target_only", "fixed_k2",
                               "--repeats", "2", "--max-new-tokens", "6", "--temperature", "0",
                               "--one-engine-at-a-time"))
    assert code == 1
    result = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert result["mismatches"] == [{"temperature": 0.0, "concurrency": 2, "method": "fixed_k2",
                                     "requests": [[0, 1], [1, 1]]}]
    assert [(b["repeat"], b["method"], b["position"]) for b in result["blocks"]] == \
        [(0, "target_only", 0), (0, "fixed_k2", 1), (1, "fixed_k2", 0), (1, "target_only", 1)]
    assert result["settings"]["engine"]["engines"] == "one at a time, per repeat"
    overview, row = [line for line in (tmp_path / "out" / "serve.md").read_text().splitlines()
                     if line.startswith("| fixed_k2 ")]
    assert "not reported" in row and "repeat 0 request 1" in row
    assert overview == "| fixed_k2 | not reported |"


# --- an interrupted run resumes (no vLLM: a stand-in engine) --------------------------------------

class FakeEngine:
    def __init__(self, spec):
        self.spec = spec


@pytest.fixture
def fake_engine(monkeypatch):
    """Engines that decode nothing: every block returns the same 3 tokens per request; the calls are counted."""
    calls = []
    monkeypatch.setattr(serve, "start_engine", lambda target, spec, engine: FakeEngine(spec))
    monkeypatch.setattr(serve, "close_engine", lambda llm: None)
    monkeypatch.setattr(serve, "warm_up", lambda llm, args, prompts: None)
    monkeypatch.setattr(serve, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(serve, "sampling", lambda temperature, args, max_tokens=None: temperature)
    monkeypatch.setattr(vllm_config, "check_version", lambda: "0.32.0")

    def run_block(llm, prompts, params):
        calls.append(llm.spec is None)
        requests = [{"output_tokens": 3, "latency_s": 0.3, "ttft_s": 0.1, "tpot_s": 0.1} for _ in prompts]
        spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        return ({"wall_s": 0.3, "output_tokens": 3 * len(prompts), "tokens_per_s": 10.0 * len(prompts),
                 "requests": requests, "spec": spec}, [[1, 2, 3] for _ in prompts])

    monkeypatch.setattr(serve, "run_block", run_block)
    return calls


def test_an_interrupted_run_resumes_from_its_complete_repeats(pair, tmp_path, fake_engine, monkeypatch):
    """Killed in its third repeat, a rerun of the same command keeps the first two repeats (every block
    once, none measured twice), measures the rest, and ends with the same blocks as an uninterrupted run;
    the checkpoint's report says it is unfinished."""
    argv = args_for(pair, tmp_path, "--concurrency", "1", "2", "--methods", "target_only", "fixed_k2",
                    "--repeats", "3", "--max-new-tokens", "3", "--temperature", "0")
    per_repeat = 2 * 2  # concurrency levels x methods
    original = serve.run_block

    def dies_in_repeat_2(llm, prompts, params):
        if len(fake_engine) == 2 * per_repeat + 1:
            raise KeyboardInterrupt
        return original(llm, prompts, params)

    monkeypatch.setattr(serve, "run_block", dies_in_repeat_2)
    with pytest.raises(KeyboardInterrupt):
        serve.main(argv)
    checkpoint = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert not checkpoint["complete"] and checkpoint["repeats_done"] == 2
    assert len(checkpoint["blocks"]) == 2 * per_repeat
    assert "unfinished: 2 done" in (tmp_path / "out" / "serve.md").read_text()

    monkeypatch.setattr(serve, "run_block", original)
    fake_engine.clear()
    assert serve.main(argv) == 0
    assert len(fake_engine) == per_repeat  # only the third repeat was measured again
    result = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert result["complete"] and result["repeats_done"] == 3
    keys = [(b["repeat"], b["concurrency"], b["method"]) for b in result["blocks"]]
    assert len(keys) == len(set(keys)) == 3 * per_repeat
    assert {r for r, _, _ in keys} == {0, 1, 2}

    fake_engine.clear()  # complete: a rerun measures nothing and rewrites the same blocks
    assert serve.main(argv) == 0 and fake_engine == []
    assert json.loads((tmp_path / "out" / "serve.json").read_text())["blocks"] == result["blocks"]


def test_a_run_does_not_resume_over_another_runs_results(pair, tmp_path, fake_engine, capsys):
    argv = args_for(pair, tmp_path, "--concurrency", "1", "--methods", "target_only", "fixed_k2",
                    "--repeats", "1", "--max-new-tokens", "3", "--temperature", "0")
    assert serve.main(argv) == 0
    before = (tmp_path / "out" / "serve.json").read_text()
    with pytest.raises(SystemExit) as exc:
        serve.main(argv[:-1] + ["1"])  # T=1 instead of 0
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "serve.json holds a run with other settings (temperatures differ)" in err and "another --out" in err
    assert (tmp_path / "out" / "serve.json").read_text() == before
