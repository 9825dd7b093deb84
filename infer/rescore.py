"""python -m infer.rescore RESULTS_DIR [--tokenizer PATH] [--allow-code-execution] [--unscored]

Recompute the task scores (specdecpp/data/tasks.py: HumanEval pass@1, GSM8K exact match) of result rows
already written, without decoding again: for files written before the scores existed, or after the
scoring changed. Each row's ``output_ids`` are decoded with the tokenizer of its target
(``pair.target``, or ``--tokenizer``). HumanEval rows (prompt source ``humaneval``) find their
problem by prompt id; other rows are scored only where they carry a ``task_reference``. Every file
is rewritten whole through a temporary file, so an interruption leaves it as it was.

HumanEval scores run each output's code, so they are recomputed only where that is allowed
(``--allow-code-execution`` or SPECDECPP_ALLOW_CODE_EXECUTION=1; confined, docs/infer.md, "Running
model-written code"); otherwise HumanEval rows are left as they are. ``--unscored``: only rows whose
task score is null (e.g. HumanEval rows decoded before code execution was allowed).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from specdecpp.data.tasks import ALLOW_ENV, code_execution_allowed, score_output, task_of
from specdecpp.models.loading import load_tokenizer

from .results import read_rows


def rescore_rows(rows: list[dict], tokenizer, allow_code_execution: bool = False, unscored: bool = False) -> list[dict]:
    """Rows with their task columns recomputed (rows without a task keep ``task`` None). Kept as they
    are: HumanEval rows where code execution is not allowed, and with ``unscored`` scored rows."""
    out = []
    for row in rows:
        source, reference = row["prompts"]["source"], row.get("task_reference")
        if (unscored and row.get("task_score") is not None) or (
                task_of(source, reference) == "humaneval" and not code_execution_allowed(allow_code_execution)):
            out.append(row)
            continue
        text = tokenizer.decode(row["output_ids"], skip_special_tokens=True)
        scores = score_output(source, row["prompt_id"], reference, text, allow_code_execution)
        stale = {"task", "task_score", "task_result", "task_reference"}
        out.append({**{k: v for k, v in row.items() if k not in stale}, **scores})
    return out


def rescore_file(path: Path, tokenizer=None, allow_code_execution: bool = False,
                 unscored: bool = False) -> tuple[int, int]:
    """Rewrite ``path`` with recomputed task scores (:func:`rescore_rows`); returns (rows, rows whose
    score changed)."""
    rows = read_rows(path)
    if not rows:
        return 0, 0
    tokenizers = {}
    new = []
    for row in rows:
        ref = str(row["pair"]["target"])
        if tokenizer is None and ref not in tokenizers:
            tokenizers[ref] = load_tokenizer(ref)
        new += rescore_rows([row], tokenizer or tokenizers[ref], allow_code_execution, unscored)
    changed = sum(a.get("task_score") != b.get("task_score") for a, b in zip(rows, new, strict=True))
    tmp = path.with_suffix(path.suffix + ".rescore")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in new))
    os.replace(tmp, path)
    return len(new), changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m infer.rescore", description=__doc__.split("\n\n")[1])
    parser.add_argument("results_dir", help="a directory of result files (searched recursively) or one .jsonl file")
    parser.add_argument("--tokenizer", help="decode with this tokenizer (a model directory or hub id) instead of "
                        "each row's pair.target")
    parser.add_argument("--allow-code-execution", action="store_true", help="run HumanEval outputs' code to score "
                        f"them, confined (or {ALLOW_ENV}=1); without it HumanEval rows are left as they are")
    parser.add_argument("--unscored", action="store_true", help="only rows whose task score is null")
    args = parser.parse_args(argv)
    root = Path(args.results_dir)
    if not root.exists():
        parser.error(f"results {str(root)!r} do not exist")
    files = [root] if root.is_file() else sorted(root.rglob("*.jsonl"))
    if not files:
        parser.error(f"no *.jsonl result files under {str(root)!r}")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    try:
        allowed = code_execution_allowed(args.allow_code_execution)
    except ValueError as exc:
        parser.error(str(exc))
    if not allowed:
        print(f"HumanEval rows are left as they are: their scores run model-written code, which needs "
              f"--allow-code-execution or {ALLOW_ENV}=1 (docs/infer.md, 'Running model-written code')")
    for f in files:
        try:
            n, changed = rescore_file(f, tokenizer, allowed, args.unscored)
        except (OSError, ValueError) as exc:
            parser.error(f"{f}: {exc}")
        print(f"{f}: {n} rows, {changed} score(s) changed")


if __name__ == "__main__":
    main()
