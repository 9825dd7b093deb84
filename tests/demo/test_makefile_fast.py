"""make demo's fast path switch (DEMO_FAST, docs/demo.md "The fast path in make demo"): auto
decodes eagerly where no CUDA device is (this CPU suite) and on CUDA graphs otherwise; a named
path goes to infer, its costs file and the report. Read from `make -n` (nothing runs)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(*settings: str) -> str:
    return subprocess.run(["make", "-n", "demo-report", f"PYTHON={sys.executable}", *settings], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks graphs on CUDA")
def test_auto_decodes_eagerly_without_cuda():
    out = dry_run()
    assert set(re.findall(r"fast=(\S+)", out)) == {"null"}
    assert "--fast" not in out and "costs_fast" not in out


@pytest.mark.parametrize("path", ["compile", "graphs"])
def test_a_named_path_reaches_infer_costs_and_report(path):
    out = dry_run(f"DEMO_FAST={path}")
    assert set(re.findall(r"fast=(\S+)", out)) == {path}
    assert f"--fast {path}" in out
    assert f"--costs reports/demo/costs.json reports/demo/costs_fast-{path}.json" in out
