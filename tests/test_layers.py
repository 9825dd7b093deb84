"""The architecture's import contracts (pyproject.toml, [tool.importlinter]) hold."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[dev]' installs import-linter")
    run = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PATH": str(Path(sys.executable).parent)})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout
