"""Running untrusted Python (model-written code) in a confined child process.

:class:`Sandbox` runs a Python script in a fresh interpreter (``python -I -B``) with

- a clean environment (``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` only: nothing of the parent's),
- an empty temporary working directory, its inputs in a separate read-only directory,
- a wall-clock limit (the whole process group, or the whole PID namespace, is killed),
- resource limits per process: address space, CPU time, file size, no core dumps, and a cap on
  the processes (threads included) its user may run beyond those already running.

Where bubblewrap (``bwrap``) can create namespaces, the child also runs under it (kind ``bwrap``):
no network (an empty network namespace), its own PID, IPC and UTS namespaces, no view of the
file system beyond the system directories and the Python installation (read-only), a private
``/tmp`` and working directory (size-capped tmpfs, gone at exit). Started as root, bwrap keeps
only the capabilities to change user and the child drops to ``nobody`` before it runs anything,
so the process cap applies (it never applies to root) and root-owned files stay closed. Where
bwrap is missing or cannot create namespaces (a container without user namespaces), the kind is
``rlimits``: the same child without namespaces, which is not a sandbox (:meth:`Sandbox.describe`
says so; :func:`specdecpp.data.tasks.run_check` runs model-written code there only when the user
allows unconfined execution). docs/infer.md, "Running model-written code", states what each
blocks and what not.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

KINDS = ("bwrap", "rlimits")
NOBODY = 65534  # the unprivileged user the child becomes when bwrap is started by root
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
INPUT, WORK = "/input", "/work"  # inside bwrap: the read-only inputs and the working directory
TMPFS = ("/tmp", WORK)  # inside bwrap: the private, size-capped tmpfs mounts
OUTPUT_TAIL = 65536  # bytes of the child's stdout and stderr read back
# Runs first in the child, before any of the script: set the limits (JSON: resource name -> value,
# never above a hard limit already there), become ``nobody`` where asked (bwrap started by root),
# then run the script with argv [script, input_dir, *args].
BOOTSTRAP = """\
import json, os, resource, sys
for name, value in json.loads(sys.argv[2]).items():
    which = getattr(resource, name)
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))
if sys.argv[1] != "-":
    os.setgroups([])
    os.setgid(int(sys.argv[1]))
    os.setuid(int(sys.argv[1]))
script = sys.argv[3]
sys.argv = sys.argv[3:]
exec(compile(open(script).read(), script, "exec"), {"__name__": "__main__", "__file__": script})
"""


@dataclass(frozen=True)
class Limits:
    """Per-process limits of the child (every process it starts inherits them)."""

    address_space: int = 2 * 2**30  # bytes of virtual memory per process (RLIMIT_AS)
    file_size: int = 16 * 2**20  # bytes any one file it writes may reach (RLIMIT_FSIZE)
    processes: int = 32  # processes and threads beyond those its user already runs (RLIMIT_NPROC)
    tmpfs: int = 64 * 2**20  # bwrap: bytes of its /tmp and of its working directory, each
    startup_s: float = 10.0  # wall and CPU seconds granted beyond the caller's timeout


@dataclass(frozen=True)
class Outcome:
    """How the child ended: its exit status (negative: the signal that killed it), whether the
    wall-clock limit killed it, and the last bytes of its stdout and stderr."""

    returncode: int
    timed_out: bool
    stdout: str
    stderr: str


def _is_root() -> bool:
    return os.geteuid() == 0


def _tasks_of(uid: int) -> int:
    """Processes and threads whose real user is ``uid`` (what RLIMIT_NPROC counts)."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # the process ended meanwhile
            continue
        if int(fields["Uid"].split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def _python_dirs() -> list[str]:
    """The directories the interpreter needs: its prefixes (a venv's and its base)."""
    return sorted({str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                     sys.base_exec_prefix)})


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _remove_tree(path: Path) -> None:
    """``rm -rf`` of a directory whose insides the child may have made unreadable (chmod 000)."""
    def unlock_and_retry(func, name, _exc):
        for p in (os.path.dirname(name), name):
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
        func(name)

    shutil.rmtree(path, onerror=unlock_and_retry)


class Sandbox:
    """Runs Python scripts confined (module docstring). ``kind`` None: bwrap where it works, else
    rlimits; ``read_only``: further directories the script needs to read (e.g. a package's
    site-packages outside the interpreter's prefix)."""

    def __init__(self, kind: str | None = None, read_only: tuple[str, ...] = (), limits: Limits = Limits()):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"sandbox kind {kind!r}: choose one of {', '.join(KINDS)}")
        self.limits = limits
        self.read_only = sorted({str(Path(p).resolve()) for p in (*_python_dirs(), *read_only)})
        self._kind = kind
        self.bwrap_problem: str | None = None  # why bwrap is not used, once probed
        self.bwrap: str | None = None  # its path, once probed

    @functools.cached_property
    def kind(self) -> str:
        """``bwrap`` or ``rlimits``; probed once (a trivial script under bwrap)."""
        if self._kind == "rlimits":
            self.bwrap_problem = "rlimits asked for"
            return "rlimits"
        self.bwrap_problem = self._probe_bwrap()
        if self.bwrap_problem is None:
            return "bwrap"
        if self._kind == "bwrap":
            raise RuntimeError(f"sandbox kind 'bwrap' asked for, but {self.bwrap_problem}")
        return "rlimits"

    @property
    def drops_to_nobody(self) -> bool:
        return self.kind == "bwrap" and _is_root()

    def _probe_bwrap(self) -> str | None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
        covering = [d for d in self.read_only if any(_within(t, d) for t in TMPFS)]
        if covering:  # bound read-only over the private tmpfs, it would leave the child no writable /tmp
            return (f"bwrap cannot confine a child here (the read-only directory {covering[0]} holds the "
                    f"sandbox's private {' and '.join(TMPFS)})")
        check = "import os, sys\nfor d in sys.argv[2:]: os.listdir(d)\nprint('ok')\n"
        probe = self._run("bwrap", check, {}, 20.0, args=self.read_only)
        if probe.returncode == 0 and probe.stdout.strip() == "ok":
            return None
        lines = (probe.stderr.strip() or probe.stdout.strip()).splitlines()
        why = lines[-1] if lines else f"exit status {probe.returncode}"
        return f"bwrap cannot confine a child here ({why})"

    def run(self, script: str, inputs: dict[str, str], timeout: float, args: tuple[str, ...] = ()) -> Outcome:
        """Run ``script`` with ``sys.argv = [script, input_dir, *args]``; ``inputs`` (file name ->
        text) are written to input_dir, which the child cannot change under bwrap. The working
        directory starts empty. Killed ``timeout + limits.startup_s`` seconds after its start."""
        return self._run(self.kind, script, inputs, timeout, args)

    def _run(self, kind: str, script: str, inputs: dict[str, str], timeout: float, args=()) -> Outcome:
        root = Path(tempfile.mkdtemp(prefix="specdecpp-sandbox-"))
        try:
            for name in ("input", "work", "tmp"):
                (root / name).mkdir()
            for name, text in {**inputs, "script.py": script}.items():
                (root / "input" / name).write_text(text)
            inside = Path(INPUT) if kind == "bwrap" else root / "input"
            uid = str(NOBODY) if kind == "bwrap" and _is_root() else "-"
            wall = timeout + self.limits.startup_s
            limits = json.dumps(self._rlimits(math.ceil(wall), _tasks_of(NOBODY if uid != "-" else os.getuid())))
            python = [sys.executable, "-I", "-B", "-c", BOOTSTRAP, uid, limits, str(inside / "script.py"), str(inside),
                      *args]
            argv = self._bwrap_argv(root) + python if kind == "bwrap" else python
            work = WORK if kind == "bwrap" else str(root / "work")
            env = {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8",
                   "TMPDIR": "/tmp" if kind == "bwrap" else str(root / "tmp")}
            with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
                proc = subprocess.Popen(argv, cwd=None if kind == "bwrap" else work, env=env, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=err, start_new_session=True)
                try:
                    proc.wait(timeout=wall)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:  # the whole group: a child's leftovers (under bwrap the namespace dies with it)
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    proc.wait()
            return Outcome(proc.returncode, timed_out, _tail(root / "stdout"), _tail(root / "stderr"))
        finally:
            _remove_tree(root)

    def _rlimits(self, cpu_s: int, tasks_now: int) -> dict[str, int]:
        """The child's limits; the process cap counts from the tasks its user runs now."""
        lim = self.limits
        return {"RLIMIT_AS": lim.address_space, "RLIMIT_CPU": cpu_s, "RLIMIT_FSIZE": lim.file_size,
                "RLIMIT_NPROC": tasks_now + lim.processes, "RLIMIT_CORE": 0}

    def _bwrap_argv(self, root: Path) -> list[str]:
        argv = [self.bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--dev", "/dev", "--proc", "/proc"]
        # root: no user namespace (the child's setuid to nobody needs these two capabilities, and
        # loses them with it); anyone else: bwrap's user namespace, as that user
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if _is_root() else ["--unshare-user"]
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                argv += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                argv += ["--ro-bind", d, d]
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        # the private tmpfs first: a later mount hides what is under it, so a Python installation
        # under /tmp (a venv there) is bound on top of the private /tmp, never below it
        for tmpfs in TMPFS:
            argv += ["--perms", "1777", "--size", str(self.limits.tmpfs), "--tmpfs", tmpfs]
        extra = [d for d in self.read_only if not any(_within(d, s) for s in SYSTEM_DIRS)]
        extra = [d for d in extra if not any(_within(d, e) and d != e for e in extra)]
        # the parents bwrap creates would copy the host's modes (/root is 0700): nobody must pass them
        parents = sorted({str(p) for d in extra for p in Path(d).parents if str(p) not in ("/", *TMPFS)})
        for p in parents:
            argv += ["--perms", "0755", "--dir", p]
        for d in extra:
            argv += ["--ro-bind", d, d]
        argv += ["--ro-bind", str(root / "input"), INPUT, "--chdir", WORK]
        return argv

    def describe(self) -> str:
        """What confines the child, in one line for the log."""
        lim = self.limits
        limits = (f"a clean environment, an empty temporary working directory, a wall-clock limit, and per process "
                  f"{lim.address_space / 2**30:g} GiB of address space, CPU time up to the wall limit, files up to "
                  f"{lim.file_size / 2**20:g} MiB, {lim.processes} processes beyond its user's")
        if self.kind == "bwrap":
            who = "as nobody (uid 65534)" if self.drops_to_nobody else f"as uid {os.getuid()} in a user namespace"
            return (f"sandbox: bubblewrap, {who}, with no network, its own PID/IPC/UTS namespaces, only the system "
                    f"directories and the Python installation visible (read-only), a private /tmp and working "
                    f"directory ({lim.tmpfs / 2**20:g} MiB tmpfs each), {limits}")
        root = " The process limit does not apply to root, which this process is." if _is_root() else ""
        return (f"NO SANDBOX ({self.bwrap_problem}): the child has only {limits}. It can read and write whatever "
                f"uid {os.getuid()} can and reach the network.{root}")


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - OUTPUT_TAIL))
        return f.read().decode("utf-8", "replace")
