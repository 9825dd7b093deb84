"""python -m infer.rescore RESULTS_DIR [--tokenizer PATH]

Recompute the task scores (specdecpp/data/tasks.py: HumanEval pass@1, GSM8K exact match) of result rows
already written, without decoding again: for files written before the scores existed, or after the
scoring changed. Each row's ``output_ids`` are decoded with the tokenizer of its target
(``pair.target``, or ``--tokenizer``). HumanEval rows (prompt source ``humaneval``) find their
problem by prompt id; other rows are scored only where they carry a ``task_reference``. Every file
is rewritten whole through a temporary file, so an interruption leaves it as it was.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from specdecpp.data.tasks import score_output
from specdecpp.models.loading import load_tokenizer

from .results import read_rows


def rescore_rows(rows: list[dict], tokenizer) -> list[dict]:
    """Rows with their task columns recomputed (rows without a task keep ``task`` None)."""
    out = []
    for row in rows:
        text = tokenizer.decode(row["output_ids"], skip_special_tokens=True)
        scores = score_output(row["prompts"]["source"], row["prompt_id"], row.get("task_reference"), text)
        stale = {"task", "task_score", "task_result", "task_reference"}
        out.append({**{k: v for k, v in row.items() if k not in stale}, **scores})
    return out


def rescore_file(path: Path, tokenizer=None) -> tuple[int, int]:
    """Rewrite ``path`` with recomputed task scores; returns (rows, rows whose score changed)."""
    rows = read_rows(path)
    if not rows:
        return 0, 0
    tokenizers = {}
    new = []
    for row in rows:
        ref = str(row["pair"]["target"])
        if tokenizer is None and ref not in tokenizers:
            tokenizers[ref] = load_tokenizer(ref)
        new += rescore_rows([row], tokenizer or tokenizers[ref])
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
    args = parser.parse_args(argv)
    root = Path(args.results_dir)
    if not root.exists():
        parser.error(f"results {str(root)!r} do not exist")
    files = [root] if root.is_file() else sorted(root.rglob("*.jsonl"))
    if not files:
        parser.error(f"no *.jsonl result files under {str(root)!r}")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    for f in files:
        try:
            n, changed = rescore_file(f, tokenizer)
        except (OSError, ValueError) as exc:
            parser.error(f"{f}: {exc}")
        print(f"{f}: {n} rows, {changed} score(s) changed")


if __name__ == "__main__":
    main()
