"""The architecture's import contracts (pyproject.toml, [tool.importlinter]) hold."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

APPS = ("infer", "train", "data_gen", "specdecpp_demo")
CLI_CONTRACT = "no module imports a command-line module"


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[dev]' installs import-linter")
    run = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PATH": str(Path(sys.executable).parent)})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def ruff_command() -> list[str] | None:
    """ruff as this interpreter's module (pip install -e '.[dev]'), else the one on PATH; None without either."""
    import importlib.util

    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    exe = shutil.which("ruff")
    return [exe] if exe else None


def test_ruff_check_passes():
    """``ruff check`` passes on the whole repository with pyproject.toml's rules, the 120-character
    line length (E501) among them."""
    command = ruff_command()
    if command is None:
        pytest.skip("ruff is not installed (pip install ruff, or pip install -e '.[dev]')")
    run = subprocess.run([*command, "check", "--no-cache", "--output-format", "concise", "."], cwd=REPO,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def is_cli(path: Path) -> bool:
    """A command-line module: a package's __main__.py, or a module with an ``if __name__ == "__main__":``."""
    if path.name == "__main__.py":
        return True
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            return True
    return False


def cli_modules() -> set[str]:
    return {".".join(p.relative_to(REPO).with_suffix("").parts) for app in APPS
            for p in (REPO / app).rglob("*.py") if is_cli(p)}


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` anywhere in the file may name (a
    ``from infer import costs`` names both infer and infer.costs)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_contract_forbids_every_command_line_module():
    """The forbidden contract's list is the command-line modules found on disk, so a new CLI is
    covered the day it is added."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"].startswith(CLI_CONTRACT)]
    clis = cli_modules()
    assert {"infer.__main__", "infer.costs", "train.__main__"} <= clis  # the detection finds CLIs
    assert set(contract["forbidden_modules"]) == clis


def test_scripts_import_no_command_line_module():
    """Tools in scripts/ (and a study's in research/) use the apps' plain modules, never a CLI:
    a CLI's helpers belong in a plain module that the CLI imports too."""
    clis = cli_modules()
    files = sorted((REPO / "scripts").glob("*.py")) + sorted((REPO / "research").rglob("*.py"))
    assert files
    offending = {str(f.relative_to(REPO)): sorted(imported_modules(f) & clis) for f in files}
    assert {f: m for f, m in offending.items() if m} == {}
