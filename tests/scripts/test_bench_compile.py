"""scripts/bench_compile.py and scripts/fast_numerics.py at their smallest: the tiny pair saved to
disk, the eager and the uncompiled static runner only (nothing compiles), float32, where both
runners must agree."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))


def test_bench_compile_times_variants_against_the_floor(tiny_pair, tmp_path, capsys):
    import bench_compile
    from torch._dynamo.utils import counters

    counters["inductor"]["fxgraph_cache_bypass"] += 3  # left by compiles earlier in the process: not this run's
    out = tmp_path / "compile.json"
    assert bench_compile.main(["--draft", tiny_pair.draft, "--target", tiny_pair.target, "--dtype", "float32",
                               "--variants", "eager,static", "--widths", "1,2", "--context", "8", "--size", "64",
                               "--repeats", "2", "--blocks", "2", "--bandwidth-mb", "4", "--out", str(out)]) == 0
    assert "| static | 2 |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["floor_ms"] > 0 and len(result["floor_ms_blocks"]) == 2 and result["model"] == "target"
    for name in ("eager", "static"):
        variant = result["variants"][name]
        assert set(variant["widths"]) == {"1", "2"}
        for row in variant["widths"].values():
            assert row["median_ms"] > 0 and len(row["block_medians_ms"]) == 2
            # each forward over the floor of the copy timed in its own round, recomputed from the raw times
            assert len(row["times_ms"]) == len(result["floor_ms_rounds"]) == 4
            paired = sorted(t / f for t, f in zip(row["times_ms"], result["floor_ms_rounds"], strict=True))
            assert row["over_floor_paired"] == pytest.approx((paired[1] + paired[2]) / 2)
            low, high = row["over_floor_paired_ci"]
            eps = 1e-9 * paired[-1]  # the bootstrap's percentiles may round an ulp past the extreme ratios
            assert paired[0] - eps <= low <= row["over_floor_paired"] + eps
            assert row["over_floor_paired"] - eps <= high <= paired[-1] + eps
        assert all(variant["argmax_equal"].values())
        assert max(variant["max_abs_diff"].values()) < 1e-4  # float32: the static runner is the eager one
        assert variant["fx_graph_cache"] == {}  # nothing compiled
    with pytest.raises(SystemExit):
        bench_compile.main(["--variants", "eager,nonsense"])
    assert "unknown variants" in capsys.readouterr().err


def test_fast_numerics_in_float32_finds_no_split(tiny_pair, tmp_path, capsys):
    import fast_numerics

    out = tmp_path / "numerics.json"
    assert fast_numerics.main(["--draft", tiny_pair.draft, "--target", tiny_pair.target, "--dtype", "float32",
                               "--variants", "eager,static", "--prompts", "2", "--max-new-tokens", "6",
                               "--out", str(out)]) == 0
    assert "| static | 0/2 |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        for name in ("eager", "static"):
            v = row["variants"][name]
            assert v["split_from_eager"] is None and v["split_from_float32"] is None  # the same float32 target
            assert v["forced"]["argmax_equal"] == v["forced"]["argmax_equal_eager"] == 1.0
            assert v["forced"]["max_abs"] < 1e-4
        assert row["variants"]["eager"]["forced"]["max_abs"] == 0.0
    with pytest.raises(SystemExit):
        fast_numerics.main(["--variants", "static,eager"])
