"""The speculative-cascade tables of `make bench-cascade` (docs/infer.md), from a report's summary.json.

    python scripts/cascade_tables.py reports/cascade/summary.json --out reports/cascade/tables.md

Per prompt set, two tables:
- the frontier: target-only and fixed K (exact) beside every cascade rule and alpha run with a fixed K,
  with tokens/s, the speedup over target-only with its paired 95% interval, target calls per token,
  the quality columns and the task score (HumanEval pass@1, GSM8K exact match) with its interval;
- stop policies under one cascade (rule, alpha): fixed K against heads (each head's labels rule from
  its config.json: trained on that cascade's labels, or on exact labels).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TASK_LABELS = {"humaneval": "HumanEval pass@1", "gsm8k": "GSM8K exact match"}


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _speedup(e: dict) -> str:
    ci = e.get("speedup_ci95")
    return _f(e.get("speedup")) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci and e.get("method") != "target_only" else "")


def _task(e: dict) -> str:
    ci = e.get("task_score_ci95")
    return "-" if e.get("task_score") is None else (f"{e['task_score']:.2f}"
                                                    + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))


def head_labels(head: str) -> str:
    """The rule of a head's training labels, from its config.json."""
    config = json.loads((Path(head) / "config.json").read_text())
    meta = (config.get("training") or {}).get("dataset_meta") or {}
    cascade = (meta.get("labels") or {}).get("cascade")
    return "exact labels" if cascade is None else f"{cascade['rule']} alpha={cascade['alpha']:g} labels"


def describe(e: dict) -> str:
    s = e["settings"]
    if e["method"] == "target_only":
        return "target-only (exact)"
    if e["method"] == "fixed_k":
        return f"fixed K={s['k']} (exact)"
    if e["method"] == "specdecpp":
        return f"SpecDec++ {Path(s['head']).name} h={s['threshold']:g} (exact)"
    if e["method"] != "cascade":
        return f"{e['method']} {e['tag']}"
    policy = s["policy"]
    stop = (f"K={policy['k']}" if s["stop"] == "fixed_k" else
            f"{Path(s['head']).name} ({head_labels(s['head'])}) h={policy['threshold']:g}"
            if s["stop"] == "specdecpp" else f"SVIP h={policy['threshold']:g}")
    return f"{s['rule']} alpha={s['alpha']:g}, {stop}"


def table(entries: list[dict], task: str | None, extra: tuple = ()) -> list[str]:
    cols = ["method", "tokens/s", "speedup [95% CI]", "target calls/token", *extra, "target log-lik/token",
            "greedy match", *([f"{TASK_LABELS[task]} [95% CI]"] if task else [])]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for e in entries:
        cells = [describe(e) + (" LOSSY" if e.get("lossy") else ""), _f(e["tokens_per_s"]), _speedup(e),
                 _f(e["verification_rate"], 3), *(_f(e.get("mean_accept_length")) for _ in extra),
                 _f(e.get("target_logprob_per_token"), 3), _f(e.get("greedy_match"), 3), *([_task(e)] if task else [])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tables(groups: list[dict], k: int, rule: str, alpha: float) -> str:
    out = []
    for g in groups:
        entries = g["entries"]
        tasks = {e.get("task") for e in entries} - {None}
        task = tasks.pop() if len(tasks) == 1 else None
        exact = [e for e in entries if not e.get("lossy")]
        frontier = [e for e in entries if e["method"] == "cascade" and e["settings"]["stop"] == "fixed_k"
                    and e["settings"]["policy"]["k"] == k]
        under = [e for e in entries if e["method"] == "cascade" and e["settings"]["rule"] == rule
                 and float(e["settings"]["alpha"]) == alpha]
        under.sort(key=lambda e: (e["settings"]["stop"] != "fixed_k", describe(e)))
        out += [f"## {g['prompts']} ({g['sampling']}, {g['device']}, {g['pair']})", "",
                f"Exact methods and every cascade at K={k}:", "", *table(exact + frontier, task), ""]
        if under:
            out += [f"Stop policies under the cascade {rule} alpha={alpha:g}:", "",
                    *table(under, task, extra=("mean accepted",)), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summary", help="summary.json written by python -m infer.report")
    ap.add_argument("--k", type=int, default=3, help="the fixed K of the rule-and-alpha grid")
    ap.add_argument("--rule", default="opt", help="the cascade whose stop policies are compared")
    ap.add_argument("--alpha", type=float, default=0.2)
    ap.add_argument("--out", help="write the tables here too (markdown)")
    args = ap.parse_args(argv)
    path = Path(args.summary)
    if not path.is_file():
        ap.error(f"summary file {str(path)!r} does not exist; run python -m infer.report RESULTS --out DIR first")
    text = tables(json.loads(path.read_text()), args.k, args.rule, args.alpha)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
