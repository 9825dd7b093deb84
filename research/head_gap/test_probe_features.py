"""research/head_gap/probe_features.py's command line: what --extra-train accepts and refuses."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "probe_features.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_features", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extra_train_spec_splits_dir_split_and_count(probe):
    assert probe.extra_train_spec("data/demo/reference_seed1:train") == ("data/demo/reference_seed1", "train", None)
    assert probe.extra_train_spec("data/demo/reference_seed1:train:64") == ("data/demo/reference_seed1", "train", 64)
    # a directory with a colon in its name keeps it; a numeric split without a count stays a split
    assert probe.extra_train_spec("runs/a:b:train:8") == ("runs/a:b", "train", 8)
    assert probe.extra_train_spec("data/x:2024") == ("data/x", "2024", None)


@pytest.mark.parametrize("spec", ["data/demo/reference_seed1", "data/x:train:0", ":train", "data/x:"])
def test_extra_train_spec_refuses_what_it_cannot_read(probe, spec):
    with pytest.raises(SystemExit, match="--extra-train"):
        probe.extra_train_spec(spec)


def _probe_row(name: str, prompts: int, auroc: float, share: float) -> dict:
    split = {"AUROC": auroc, "share_of_perfect": share, "probe": {"margin": share * 0.07}}
    return {"set": name, "train_prompts": prompts, "train_positions": 140 * prompts,
            "splits": {"dev": split, "data/demo/heldout_bundled:test": split}}


def test_learning_curve_places_rows_by_set_and_size_and_plots(tmp_path):
    import json
    import subprocess
    import sys

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"results": [_probe_row("today's [train 50%, width 256]", 115, 0.72, 0.2),
                                         _probe_row("today's [train 100%, width 256]", 230, 0.73, 0.25)]}))
    # b repeats the 230-response point (it wins) and adds 460
    b.write_text(json.dumps({"results": [_probe_row("today's [train 50%, width 256]", 230, 0.74, 0.27),
                                         _probe_row("today's [train 100%, width 256]", 460, 0.75, 0.3)]}))
    out = tmp_path / "curve.png"
    run = subprocess.run([sys.executable, str(SCRIPT.parent / "plot_learning_curve.py"), str(a), str(b),
                          "--out", str(out)], capture_output=True, text=True, check=True)
    rows = [line for line in run.stdout.splitlines() if line.startswith("| today's |")]
    assert [r.split(" | ")[1] for r in rows] == ["115 (16100)", "230 (32200)", "460 (64400)"]
    assert "0.740" in rows[1] and "(0.27)" in rows[1]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    run = subprocess.run([sys.executable, str(SCRIPT.parent / "plot_learning_curve.py"), str(bad)],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "bad.json" in run.stderr


def test_cached_blocks_computes_once_per_dataset_and_labelling_run(probe, tmp_path):
    import numpy as np

    calls = []

    def compute(value):
        def run():
            calls.append(value)
            return {"labels": np.full(3, value, dtype=np.float32), "row_len": np.array([3])}
        return run

    meta = {"created": "2026-01-01", "draft": "d", "target": "t"}
    first = probe.cached_blocks(str(tmp_path), "data/x", "train", None, meta, compute(1.0))
    again = probe.cached_blocks(str(tmp_path), "data/x", "train", None, meta, compute(2.0))
    assert calls == [1.0] and np.array_equal(first["labels"], again["labels"])
    # another split, another row count or a relabelled dataset is another entry
    probe.cached_blocks(str(tmp_path), "data/x", "dev", None, meta, compute(3.0))
    probe.cached_blocks(str(tmp_path), "data/x", "train", 2, meta, compute(4.0))
    relabelled = probe.cached_blocks(str(tmp_path), "data/x", "train", None, {**meta, "created": "2026-02-02"},
                                     compute(5.0))
    assert calls == [1.0, 3.0, 4.0, 5.0] and relabelled["labels"][0] == 5.0
    # the main dev split's blocks carry the label check, an --eval of the same split's do not
    probe.cached_blocks(str(tmp_path), "data/x", "train", None, meta, compute(7.0), checked=True)
    assert calls[-1] == 7.0
    assert not list(tmp_path.glob("*.tmp.npz"))
    # without a cache directory nothing is kept
    probe.cached_blocks(None, "data/x", "train", None, meta, compute(6.0))
    assert calls[-1] == 6.0


def test_probe_bilinear_term_is_the_low_rank_product_of_its_two_blocks(probe):
    import torch

    torch.manual_seed(0)
    x = torch.randn(5, 7)
    a, b = slice(0, 3), slice(3, 6)
    plain = probe.Probe(7, 16)
    with_term = probe.Probe(7, 16, bilinear=2, pair=(a, b))
    with_term.load_state_dict({**plain.state_dict(), "u.weight": with_term.u.weight, "v.weight": with_term.v.weight})
    expected = plain(x) + ((x[:, a] @ with_term.u.weight.T) * (x[:, b] @ with_term.v.weight.T)).sum(-1)
    assert torch.allclose(with_term(x), expected, atol=1e-6)
    assert not torch.allclose(with_term(x), plain(x))
    cols = probe.block_slices({"hidden": torch.zeros(1, 4), "embedding": torch.zeros(1, 4), "q": torch.zeros(1, 3)},
                              ["q", "embedding", "hidden"])
    assert cols == {"q": slice(0, 3), "embedding": slice(3, 7), "hidden": slice(7, 11)}
