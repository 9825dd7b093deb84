"""scripts/bench_fast.py at its smallest: tiny random Llamas (--configs), the static runner, two
prompts (batches: four); eager and fast decode the same greedy tokens and the JSON holds what the
table shows."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch

from tests.helpers.paths import REPO
from tests.models.test_graphs import graphs_on  # noqa: F401  (a fixture)

ROOT = REPO
sys.path.insert(0, str(ROOT / "scripts"))


SHAPES = {"draft": (32, 1), "target": (48, 2)}  # role: (hidden size, layers); vocabulary 64
# the compiled test's pair: both of tests/helpers/tiny.py's tiny_lm(32, 32, 2) shape, whose steps the other compiled
# tests compile too (inductor's FX graph cache then serves them), the draft's buckets the target's kernels
COMPILED_SHAPES = {"draft": (32, 2), "target": (32, 2)}


def write_configs(folder, shapes: dict = SHAPES, vocab: int = 64) -> None:
    """Tiny random Llamas' configs, draft.json and target.json (--configs)."""
    base = {"vocab_size": vocab, "max_position_embeddings": 512, "tie_word_embeddings": False,
            "initializer_range": 0.4, "num_attention_heads": 4, "num_key_value_heads": 2}
    for role, (hidden, layers) in shapes.items():
        (folder / f"{role}.json").write_text(json.dumps(
            {**base, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers}))


def test_bench_fast_on_tiny_random_models(tmp_path, capsys):
    import bench_fast

    write_configs(tmp_path)
    out = tmp_path / "bench.json"
    assert bench_fast.main(["--configs", str(tmp_path), "--fast", "static", "--device", "cpu", "--dtype", "float32",
                            "--prompts", "2", "--max-new-tokens", "8", "--prompt-len", "8", "--context", "16",
                            "--repeats", "2", "--bandwidth-mb", "4", "--require-equal", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| fixed_k3 |" in printed and "Memory bandwidth" in printed and "Compile time" in printed
    result = json.loads(out.read_text())
    assert {"machine", "device", "dtype", "fast", "forwards", "floor", "methods", "compile_seconds",
            "prompts"} <= set(result)
    assert result["fast"] == "static" and result["dtype"] == "float32" and result["prompts"] == 2
    for backend in ("eager", "fast"):
        assert set(result["forwards"][backend]["target"]) == {"1", "2", "4", "8"}
        assert result["forwards"][backend]["draft"]["1"] > 0
    assert result["floor"]["bandwidth_gb_s"] > 0 and result["floor"]["floor_ms"] > 0
    assert set(result["methods"]) == {"target_only", "fixed_k1", "fixed_k2", "fixed_k3", "svip"}
    for name, m in result["methods"].items():
        assert m["greedy_equal"] and m["unequal_prompts"] == [], name
        assert m["eager"]["n_generated"] == m["fast"]["n_generated"] == 16
        assert m["fast_over_eager"]["ratio"] > 0 and len(m["fast_over_eager"]["ci95"]) == 2
        assert m["eager"]["ms_per_round"] > 0
        for backend in ("eager", "fast"):
            a = m[backend]["after_first"]
            assert a["ms_per_round"] > 0 and a["forwards_ms_per_round_est"] > 0 and a["replayed_rounds"] == 0
    assert "Outside the forwards" in printed
    assert result["compile_seconds"] == {}  # static: nothing compiled
    with pytest.raises(SystemExit):
        bench_fast.main(["--random", "--configs", str(tmp_path)])
    assert "not both" in capsys.readouterr().err


def test_bench_fast_breakdown_splits_each_round_and_profiles_the_loop(tmp_path, capsys):
    """--breakdown: per method and backend, the draft's and the target's forwards, the rest of the
    fast feeds and the loop add up to the rounds' time; --profile-outside ranks the loop's functions."""
    import bench_fast

    write_configs(tmp_path)
    out = tmp_path / "bench.json"
    assert bench_fast.main(["--configs", str(tmp_path), "--fast", "static", "--device", "cpu", "--dtype", "float32",
                            "--prompts", "2", "--max-new-tokens", "8", "--prompt-len", "8", "--context", "16",
                            "--repeats", "2", "--bandwidth-mb", "4", "--sampling", "paper", "--require-equal",
                            "--breakdown", "--profile-outside", "5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Where a round's time goes" in printed and "cProfile, svip fast" in printed
    result = json.loads(out.read_text())
    assert result["sampling"] == "paper"
    for name, m in result["methods"].items():
        assert m["greedy_equal"], name  # float32, the same seeds: the same sampled tokens
        for backend in ("eager", "fast"):
            b = m[backend]["breakdown"]
            parts = ("draft_forward", "target_forward", "in_feed", "loop")
            assert sum(b[f"{k}_share"] for k in parts) == pytest.approx(1.0), (name, backend)
            assert b["outside_share"] == pytest.approx(b["in_feed_share"] + b["loop_share"])
            assert b["target_forward_share"] > 0 and b["rounds"] > 0
            assert (b["draft_forward_share"] == 0) == (name == "target_only"), (name, backend)
            assert (b["in_feed_share"] == 0) == (backend == "eager"), (name, backend)  # eager: the feed is the forward
            assert b["mask_share"] > 0 if backend == "fast" else b["mask_share"] == 0
            low, high = b["outside_share_ci95"]  # per call, pooled over resampled prompts: around the pooled share
            assert low <= b["outside_share"] <= high and high < 1, (name, backend)
    assert "outside the forwards [95% CI over prompts]" in printed
    for name, p in result["profile_outside"].items():
        assert len(p["top"]) == 5 and 0 < p["steps_share"] < 1, name
        assert all("static_step" not in f["function"] for f in p["top"]), name  # the forwards are not listed
    assert result["breakdown_pass"] == "same"  # on a CPU the meters wait for nothing: they time the timed pass
    with pytest.raises(SystemExit):
        bench_fast.main(["--configs", str(tmp_path), "--profile-outside", "3"])
    assert "--profile-outside needs --breakdown" in capsys.readouterr().err


def test_bench_fast_breakdown_in_a_pass_of_its_own(tmp_path, capsys):
    """--breakdown-pass separate (the default on CUDA, where the meters synchronise): the timed pass runs
    without meters, a second pass with the same seeds is metered; its rounds are the timed pass's rounds
    (the same tokens), and its shares add up."""
    import bench_fast

    write_configs(tmp_path)
    out = tmp_path / "bench.json"
    assert bench_fast.main(["--configs", str(tmp_path), "--fast", "static", "--device", "cpu", "--dtype", "float32",
                            "--prompts", "2", "--max-new-tokens", "8", "--prompt-len", "8", "--context", "16",
                            "--repeats", "2", "--bandwidth-mb", "4", "--sampling", "paper", "--breakdown",
                            "--breakdown-pass", "separate", "--out", str(out)]) == 0
    assert "decoded again under the breakdown's meters" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["breakdown_pass"] == "separate"
    for name, m in result["methods"].items():
        for backend in ("eager", "fast"):
            b = m[backend]["breakdown"]
            wall = m[backend]["n_generated"] / m[backend]["tokens_per_s"]  # the timed pass's seconds and rounds
            assert b["rounds"] == round(1e3 * wall / m[backend]["ms_per_round"]), (name, backend)
            parts = ("draft_forward", "target_forward", "in_feed", "loop")
            assert sum(b[f"{k}_share"] for k in parts) == pytest.approx(1.0), (name, backend)


def test_bench_fast_batches_on_tiny_random_models(tmp_path, capsys):
    import bench_fast

    write_configs(tmp_path)
    out = tmp_path / "bench.json"
    assert bench_fast.main(["--configs", str(tmp_path), "--fast", "static", "--device", "cpu", "--dtype", "float32",
                            "--prompts", "4", "--max-new-tokens", "6", "--prompt-len", "5", "--batch", "2", "4",
                            "--require-equal", "--out", str(out)]) == 0
    assert "| 4 | fixed_k2 |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["fast"] == ["static"] and result["units"] == {"2": 2, "4": 1}
    for size in ("2", "4"):
        assert set(result["batches"][size]) == {"target_only", "fixed_k2", "sample"}
        for name, m in result["batches"][size].items():
            assert m["eager"]["n_generated"] == m["static"]["n_generated"] == 24, (size, name)
            assert m["static"]["greedy_equal"] and m["static"]["over_eager"]["ratio"] > 0
    assert len(result["batches"]["2"]["fixed_k2"]["static"]["over_target_only"]["ci95"]) == 2  # two calls
    with pytest.raises(SystemExit):
        bench_fast.main(["--configs", str(tmp_path), "--fast", "static", "compile"])
    assert "--fast takes one backend" in capsys.readouterr().err


def test_bench_fast_batches_of_one_method(tmp_path, capsys):
    """--batch-methods sample: data_gen's sampling alone, eager against fast, the same greedy tokens."""
    import bench_fast

    write_configs(tmp_path)
    out = tmp_path / "bench.json"
    assert bench_fast.main(["--configs", str(tmp_path), "--fast", "static", "--device", "cpu", "--dtype", "float32",
                            "--prompts", "4", "--max-new-tokens", "6", "--prompt-len", "5", "--batch", "4",
                            "--batch-methods", "sample", "--require-equal", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 4 | sample |" in printed and "fixed_k2" not in printed
    result = json.loads(out.read_text())
    assert set(result["batches"]["4"]) == {"sample"} and result["units"] == {"4": 1}
    m = result["batches"]["4"]["sample"]
    assert m["eager"]["n_generated"] == m["static"]["n_generated"] == 24 and m["static"]["greedy_equal"]


def test_after_first_counts_the_rounds_after_the_prefill_against_their_forwards():
    """Two calls' rows by hand: the first round of each is left out, a round of K candidates costs
    t_target at the smallest measured width >= K + 1 (the widest beyond) plus K one-token draft
    forwards, and a replayed round's first draft forward is a two-token one (a target-only
    replay drafts nothing)."""
    import bench_fast

    times = {"target": {"1": 0.010, "2": 0.012, "4": 0.016}, "draft": {"1": 0.001, "2": 0.0015}}
    rows = [{"wall_time_s": 0.5, "first_round_s": 0.1, "candidate_lengths": [3, 3, 1, 6], "draft_forwards": 13,
             "replayed_rounds": 2},
            {"wall_time_s": 0.2, "first_round_s": 0.05, "candidate_lengths": [0, 0], "draft_forwards": 0,
             "replayed_rounds": 1}]
    a = bench_fast.after_first(rows, times)
    # K = 3, 1, 6 (width 7: the widest), then K = 0
    forwards = (0.016 + 0.012 + 0.016) + 10 * 0.001 + 2 * 0.0005 + 0.010
    assert a["ms_per_round"] == pytest.approx(1e3 * (0.4 + 0.15) / 4)
    assert a["forwards_ms_per_round_est"] == pytest.approx(1e3 * forwards / 4)
    assert a["outside_share_est"] == pytest.approx(1 - forwards / 0.55)
    assert a["replayed_rounds"] == 3
    assert bench_fast.after_first([{**rows[1], "candidate_lengths": [0]}], times) == {}


def graphs_bench(tmp_path, capsys, prompts: int, *flags: str, fast: str = "graphs", shapes: dict = SHAPES,
                 vocab: int = 64) -> tuple[str, dict]:
    """bench_fast --fast graphs (or ``fast``) on tiny random models (the fake capture installed by the
    caller; ``shapes`` and ``vocab``: write_configs), 12 new tokens, greedy tokens required equal: what it
    printed and its JSON."""
    import bench_fast

    write_configs(tmp_path, shapes, vocab)
    out = tmp_path / "bench.json"
    assert bench_fast.main(["--configs", str(tmp_path), "--fast", fast, "--device", "cpu", "--dtype", "float32",
                            "--prompts", str(prompts), "--max-new-tokens", "12", "--prompt-len", "8", "--context", "16",
                            "--repeats", "2", "--bandwidth-mb", "4", "--require-equal", *flags, "--out", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_bench_fast_times_round_graphs_against_their_forwards(tmp_path, capsys, graphs_on):  # noqa: F811
    """--fast graphs on the CPU's fake capture (tests/models/test_graphs.py): the rounds of every method
    are captured (replayed in decoding; SVIP's a candidate at a time), and --round-graphs times each
    whole-round graph (target-only, fixed K) and a graph of its forwards alone, one row per K, beside
    that method's decoding ms per round."""
    import bench_fast

    graphs_on("cpu")
    printed, result = graphs_bench(tmp_path, capsys, 2, "--round-graphs")
    assert "Captured rounds against their forwards" in printed and "| fixed_k3 | 3 | 4 |" in printed
    assert "| fixed_k1 | 1 | 2 |" in printed  # not SVIP, whose rounds mostly draft 1 too (its graphs are steps)
    # capture times: the whole rounds by K, SVIP's graphs by its most candidates (--svip-max 8, 12 tokens: 8)
    assert "round target K3 w4" in printed and any(k.startswith("steps target K8 w16 s")
                                                   for k in result["compile_seconds"])
    assert sorted(r["k"] for r in result["round_graphs"]) == [0, 1, 2, 3]
    for r in result["round_graphs"]:  # alternating blocks, the medians and the mean difference from them
        assert r["round_graph_ms"] > 0 and r["forwards_graph_ms"] > 0 and r["blocks"] == bench_fast.ROUND_GRAPH_BLOCKS
        rounds, forwards = r["round_graph_ms_blocks"], r["forwards_graph_ms_blocks"]
        assert len(rounds) == len(forwards) == r["blocks"]
        assert r["round_graph_ms"] == pytest.approx(float(np.median(rounds)))
        assert r["outside_ms"] == pytest.approx(float(np.mean(np.subtract(rounds, forwards))))
        assert r["outside_ms_ci"][0] <= r["outside_ms"] <= r["outside_ms_ci"][1]
    assert "of it on the device [95% CI]" in printed
    for name in ("target_only", "fixed_k1", "fixed_k2", "fixed_k3", "svip"):  # SVIP's a candidate at a time
        assert result["methods"][name]["fast"]["after_first"]["replayed_rounds"] > 0, name
    with pytest.raises(SystemExit):
        bench_fast.main(["--configs", str(tmp_path), "--fast", "static", "--round-graphs"])
    assert "--round-graphs needs" in capsys.readouterr().err


def test_bench_fast_compares_captured_rounds_with_per_forward_graphs_in_one_pass(tmp_path, capsys, graphs_on):  # noqa: F811
    """--also-per-forward on the CPU's fake capture: each method decodes eager, with rounds captured and
    with rounds not captured, in one interleaved pass; the captured decoder replays rounds and the
    per-forward one none, greedy both give the target's tokens, and the ratio with its interval is
    recomputed from the JSON's pooled rates."""
    import bench_fast

    graphs_on("cpu")
    printed, result = graphs_bench(tmp_path, capsys, 3, "--also-per-forward")
    assert "Rounds captured against per-forward graphs" in printed and "| per_forward |" in printed
    for name, m in result["methods"].items():
        assert m["fast"]["after_first"]["replayed_rounds"] > 0, name
        assert m["per_forward"]["after_first"]["replayed_rounds"] == 0, name
        assert m["per_forward"]["n_generated"] == m["fast"]["n_generated"] == 36
        assert m["per_forward_unequal_prompts"] == [] and m["greedy_equal"], name
        c = m["captured_over_per_forward"]
        assert c["ratio"] == pytest.approx(m["fast"]["tokens_per_s"] / m["per_forward"]["tokens_per_s"])
        assert c["ci95"] is not None and len(c["ci95"]) == 2
    with pytest.raises(SystemExit):
        bench_fast.main(["--configs", str(tmp_path), "--fast", "graphs", "--also-per-forward", "--no-capture-rounds"])
    assert "--also-per-forward needs" in capsys.readouterr().err


def test_decode_all_rotates_each_methods_backends_from_prompt_to_prompt():
    """The order of a method's backends on prompt j is its list rotated by j (two backends: swapped on
    odd prompts), every method before the next prompt."""
    import bench_fast

    calls = []

    class Recorder:
        def __init__(self, key):
            self.key = key

        def generate(self, prompt, max_new_tokens, generator, eos_token_id=None):
            calls.append((int(prompt[0, 0]), self.key))
            stats = types.SimpleNamespace(n_generated=1, wall_time_s=1.0, accept_lengths=[0], first_round_s=0.5,
                                          candidate_lengths=[0], n_draft_calls=0, replayed_rounds=0)
            return types.SimpleNamespace(stats=stats, tokens=torch.cat([prompt, prompt[:, :1]], 1))

    keys = [("a", None), ("a", "graphs"), ("a", "per-forward"), ("b", None), ("b", "graphs")]
    args = type("A", (), {"max_new_tokens": 1, "seed": 0})()
    rows = bench_fast.decode_all({k: Recorder(k) for k in keys}, [torch.tensor([[j]]) for j in range(3)], args, None)
    assert calls == [
        (0, ("a", None)), (0, ("a", "graphs")), (0, ("a", "per-forward")), (0, ("b", None)), (0, ("b", "graphs")),
        (1, ("a", "graphs")), (1, ("a", "per-forward")), (1, ("a", None)), (1, ("b", "graphs")), (1, ("b", None)),
        (2, ("a", "per-forward")), (2, ("a", None)), (2, ("a", "graphs")), (2, ("b", None)), (2, ("b", "graphs"))]
    assert all(len(r) == 3 for r in rows.values())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
def test_bench_fast_fused_rounds_on_compile_graphs(tmp_path, capsys, graphs_on):  # noqa: F811
    """--fused-rounds (compile-graphs, the CPU's fake capture): every method's fast decoder replays rounds
    whose glue is compiled, greedy tokens equal eager's (--require-equal), the JSON says so, and
    --round-graphs times the fused round graphs; without compile-graphs the flag is refused. Its pair has
    the compiled tests' shape (COMPILED_SHAPES, vocabulary 32) and SVIP at most 4 candidates (buckets up to 8,
    as the exactness registry's): every step it compiles is one the other compiled tests compile too."""
    import bench_fast

    graphs_on("cpu")
    printed, result = graphs_bench(tmp_path, capsys, 2, "--fused-rounds", "--round-graphs", "--also-per-forward",
                                   "--also-unfused", "--svip-max", "4", fast="compile-graphs",
                                   shapes=COMPILED_SHAPES, vocab=32)
    assert result["capture_rounds"] == "fused" and "capture_rounds=fused" in printed
    assert "Fused rounds against plain captured rounds" in printed
    for name, m in result["methods"].items():
        assert m["fast"]["after_first"]["replayed_rounds"] > 0, name
        assert m["unfused"]["after_first"]["replayed_rounds"] > 0, name
        assert m["unfused_unequal_prompts"] == [], name  # greedy: fused and plain captured rounds agree
        assert m["fused_over_unfused"]["ratio"] > 0, name
    graphs = sorted((r["k"], r["fused"]) for r in result["round_graphs"])  # both kinds of round graph, timed
    assert graphs == [(k, fused) for k in (0, 1, 2, 3) for fused in (False, True)]
    assert "fixed_k1 (fused)" in printed and "fixed_k1 (unfused)" in printed
    with pytest.raises(SystemExit):
        bench_fast.main(["--configs", str(tmp_path), "--fast", "graphs", "--fused-rounds"])
    assert "--fused-rounds needs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_fast.main(["--configs", str(tmp_path), "--fast", "compile-graphs", "--also-unfused"])
    assert "--also-unfused needs --fused-rounds" in capsys.readouterr().err
