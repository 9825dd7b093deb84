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
