"""scripts/count_step_ops.py: the operations a static step dispatches, counted on tiny Llamas. Each
decoder layer adds the same operations, seven of them matrix products (q, k, v, o, gate, up, down), and
the output layer one more; the views are told apart from the operations that launch work."""

from __future__ import annotations

import json
import sys

from tests.helpers.paths import REPO
from tests.helpers.tiny import tiny_lm
from tests.scripts.test_bench_fast import write_configs

sys.path.insert(0, str(REPO / "scripts"))


def test_counts_grow_by_one_layer_of_operations_per_layer():
    from count_step_ops import VIEWS, count_feed

    counts = {layers: count_feed(tiny_lm(64, 32, layers, seed=1), width=1) for layers in (1, 2, 3)}
    work = {n: sum(v for k, v in c.items() if k not in VIEWS) for n, c in counts.items()}
    assert all(counts[n]["mm"] == 7 * n + 1 for n in counts)  # seven per layer, one for the output layer
    assert work[3] - work[2] == work[2] - work[1] > 7  # a layer's share is the same for every layer
    assert 0 < sum(counts[1].values()) - work[1]  # views are counted apart


def test_main_prints_a_row_per_model_and_width(tmp_path, capsys):
    import count_step_ops

    write_configs(tmp_path)  # a 1-layer draft and a 2-layer target
    out = tmp_path / "ops.json"
    assert count_step_ops.main(["--configs", str(tmp_path), "--widths", "1", "2", "--out", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| draft", "| target"))]
    assert len(rows) == 4
    result = json.loads(out.read_text())
    assert result["draft_w1"]["layers"] == 1 and result["draft_w1"]["by_name"]["mm"] == 7 + 1
    assert result["target_w2"]["layers"] == 2 and result["target_w2"]["by_name"]["mm"] == 2 * 7 + 1


def test_a_round_loop_counts_the_cuda_way_and_reads_no_scalar(tmp_path, capsys):
    """--loop: a chain round's loop on the CUDA path. Each drafted token adds the same operations (greedy:
    the argmax and its write; sampled: the warp, the draw and its write), sampling costs more than greedy,
    the dense top-k is the one counted (CUDA's, not the CPU's sparse rows), and no operation reads a
    scalar to the host one at a time (``item``/``int``: each a synchronisation on CUDA)."""
    import count_step_ops
    from count_step_ops import VIEWS, count_round_loop

    work = {(s, k): sum(v for name, v in count_round_loop(k, s, 4096).items() if name not in VIEWS)
            for s in ("greedy", "sampled") for k in (0, 1, 2, 3)}
    for s in ("greedy", "sampled"):
        assert work[(s, 3)] - work[(s, 2)] == work[(s, 2)] - work[(s, 1)] > 0, s
    assert all(work[("sampled", k)] > work[("greedy", k)] for k in range(4))
    counts = count_round_loop(3, "sampled", 4096)
    assert counts["topk"] == 4 and counts["_local_scalar_dense"] == 0  # 3 draft rows, the target's 4 in one
    out = tmp_path / "loop.json"
    assert count_step_ops.main(["--loop", "--out", str(out)]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines()
                if line.startswith(("| greedy", "| sampled"))]) == 6
    assert set(json.loads(out.read_text())) == {f"{s}_k{k}" for s in ("greedy", "sampled") for k in (0, 1, 3)}


def test_a_captured_round_counts_its_glue_only_and_checks_the_draft_rows_once(tmp_path, capsys):
    """--captured: what a captured round holds outside its forwards. The forwards (and their staging)
    are not counted: a greedy target-only round is its argmax, the verdict's bookkeeping and the token's
    write, with no matrix product; each drafted candidate adds the same operations; nothing is drawn
    (the uniforms come in from outside) and nothing is read on the host. Sampled, the draft's rows are
    checked once, in the verdict: a candidate's draw computes no check of its own, so a candidate adds
    one ``amin`` (its warp's k-th largest logit) and no more whatever K."""
    import count_step_ops
    from count_step_ops import VIEWS, count_captured_round

    counts = {(s, k): count_captured_round(k, s, 512) for s in ("greedy", "sampled") for k in (0, 1, 2, 3)}
    work = {key: sum(v for name, v in c.items() if name not in VIEWS) for key, c in counts.items()}
    assert all(c["mm"] == 0 and c["rand"] == 0 and c["_local_scalar_dense"] == 0 for c in counts.values())
    assert counts[("greedy", 0)]["max"] == 1 and work[("greedy", 0)] < 10
    assert work[("sampled", 3)] - work[("sampled", 2)] == work[("sampled", 2)] - work[("sampled", 1)] > 0
    # a candidate's warp takes one amin, the target's warp one, the verdict's checks of its draw and of q one each
    assert [counts[("sampled", k)]["amin"] for k in (1, 2, 3)] == [4, 5, 6]
    svip = count_captured_round(3, "sampled", 512, "svip")
    assert svip["rand"] == 0 and svip["_local_scalar_dense"] == 0 and svip["amin"] == 6
    out = tmp_path / "captured.json"
    assert count_step_ops.main(["--captured", "--out", str(out)]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines()
                if line.startswith(("| target-only", "| fixed", "| svip"))]) == 10
    assert len(json.loads(out.read_text())) == 10
