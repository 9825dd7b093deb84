"""scripts/probe_features.py's command line: what --extra-train accepts and refuses."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_features.py"


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
