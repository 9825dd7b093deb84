"""python -m infer.report RESULTS_DIR [--out reports/NAME]

Reads every result file under RESULTS_DIR and writes report.md, summary.json and PNG plots (one
Pareto plot and one throughput plot per pair / prompt set / sampling group) to the out
directory, and prints the report.
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from specdecpp.analysis.costmodel import Costs, load_costs
from specdecpp.data.tasks import ALLOW_ENV

from .plots import pareto_plot, quality_plot, throughput_plot
from .results import read_result_dir
from .summary import R2_WARNING, summarize_results

COLUMNS = ("method", "settings", "prompts", "tokens/s", "speedup", "95% CI", "Eq. 2.3 speedup",
           "Eq. 2.3 speedup, t_target(n)", "measured/Eq. 2.3", "outside forwards", "both busy", "mean accepted",
           "discard rate", "verification rate", "target log-lik/token", "greedy match")


TASK_LABELS = {"humaneval": "HumanEval pass@1", "gsm8k": "GSM8K exact match"}
# An interval bootstrapped from fewer prompts (batches: generate_batch calls) is marked with a dagger:
# 3-6 values resampled give a rough interval.
FEW_PROMPTS = 10
FEW_MARK = "†"
LEGEND = 'Columns and tags: docs/infer.md, "Report columns".'
FEW_NOTE = f"{FEW_MARK} bootstrapped from fewer than {FEW_PROMPTS} prompts (or batch calls): a rough interval."


def group_task(group: dict) -> str | None:
    """The task the group's rows are scored by (one prompt set: one task), or None."""
    tasks = {e.get("task") for e in group["entries"]} - {None}
    return tasks.pop() if len(tasks) == 1 else None


def _few(ci, n: int) -> bool:
    """An interval bootstrapped from fewer than FEW_PROMPTS prompts (or batch calls)."""
    return bool(ci) and n < FEW_PROMPTS


def _interval(ci, n: int, digits: int = 2) -> str:
    """``[lo, hi]``, marked when bootstrapped from few values (:func:`_few`); '' for none."""
    if not ci:
        return ""
    return f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" + (FEW_MARK if _few(ci, n) else "")


def _task_cell(e: dict) -> str:
    if e.get("task_score") is None:
        return "not run" if e.get("task_unscored") else "-"
    ci = _interval(e.get("task_score_ci95"), e.get("task_n", 0))
    return f"{e['task_score']:.3f}" + (f" {ci}" if ci else "")


def unscored_line(group: dict, results_dir) -> str:
    """How to score rows whose task score is null (model-written code not allowed to run), or ''."""
    n = sum(e.get("task_unscored") or 0 for e in group["entries"])
    if not n:
        return ""
    return (f"{TASK_LABELS.get(group_task(group), 'Task score')}: not run for {n} rows: model-written code runs only "
            f"when allowed. To score them, each check confined (docs/infer.md, 'Running model-written code'): "
            f"`{ALLOW_ENV}=1 python -m infer.rescore {results_dir} --unscored`, then this report again.")


def _f(x, digits: int = 2, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def group_table(group: dict) -> str:
    task = group_task(group)
    columns = COLUMNS + ((f"{TASK_LABELS[task]} [95% CI]",) if task else ())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for e in group["entries"]:
        speedup = (_f(e["speedup"], suffix="x") if e["timed"]
                   else _f(e["speedup_predicted"], suffix="x (Eq. 2.3)"))
        lines.append("| " + " | ".join([
            e["method"] + (" (LOSSY)" if e.get("lossy") else ""), e["tag"] if e["settings"] else "-",
            str(e["n_prompts"]), _f(e["tokens_per_s"]), speedup,
            _interval(e.get("speedup_ci95"), e.get("speedup_ci_n", 0)) or "-",
            _f(e["speedup_predicted"], suffix="x"), _f(e.get("speedup_width_predicted"), suffix="x"),
            _f(e["measured_over_predicted"]),
            _f(None if e["outside_forward_share"] is None else 100 * e["outside_forward_share"], 1, "%"),
            _f(None if e.get("both_busy_share") is None else 100 * e["both_busy_share"], 1, "%"),
            _f(e["mean_accept_length"]), _f(e["discard_rate"], 3), _f(e["verification_rate"], 3),
            _f(e.get("target_logprob_per_token"), 3), _f(e.get("greedy_match"), 3),
            *((_task_cell(e),) if task else ()),
        ]) + " |")
    return "\n".join(lines)


def tree_lines(group: dict) -> str:
    """Token trees: measured tokens per target call beside the DP's G(n, d) for the tree."""
    lines = []
    for e in group["entries"]:
        if e.get("tokens_per_target_call") is None:
            continue
        g = e["settings"].get("expected_tokens")
        lines.append(f"- {e['method']} {e['tag']}: {e['tokens_per_target_call']:.2f} tokens per target call"
                     + (f" (the DP's G(n, d) = {g:.2f}: measured / predicted {e['tokens_per_target_call'] / g:.2f})"
                        if g else ""))
    return "\n".join(lines)


def _ratio_cell(v: dict, method: str) -> str:
    """``1.052x [0.98, 1.11] over fixed_k k4 (not told apart)``: a tokens/s ratio, its paired interval
    and what the interval says."""
    ci = v["ci95"]
    verdict = "" if ci is None else " (faster)" if ci[0] > 1 else " (slower)" if ci[1] < 1 else " (not told apart)"
    return (f"{v['ratio']:.3f}x" + (f" {_interval(ci, v.get('ci_n', 0), 3)}" if ci else "")
            + f" over {method} {v['tag']}{verdict}")


def baseline_lines(group: dict) -> str:
    """Each method against the fastest fixed K and the fastest SVIP of the same table, paired."""
    lines = []
    for e in group["entries"]:
        cells = [_ratio_cell(v, method) for method, v in e.get("vs_best", {}).items()]
        if cells and e["method"] not in ("fixed_k", "svip"):
            lines.append(f"- {e['method']} {e['tag'] if e['settings'] else '-'}: " + "; ".join(cells))
    if not lines:
        return ""
    return "Against the fastest fixed K and SVIP of this table (tokens/s ratio, paired 95% interval):\n\n" + \
        "\n".join(lines)


def eager_lines(group: dict) -> str:
    """A fast table: each method's tokens/s over its own eager run (paired over prompts)."""
    cells = [f"{e['method']} {e['tag'] if e['settings'] else '-'} {v['ratio']:.2f}x"
             + (f" {_interval(v['ci95'], v.get('ci_n', 0))}" if v.get("ci95") else "")
             for e in group["entries"] if (v := e.get("vs_eager"))]
    if not cells:
        return ""
    return (f"Fast over eager, each method on {_fast_name(group['fast'])} against its own eager run of the same "
            "prompts (tokens/s ratio, paired 95% interval): " + "; ".join(cells) + ".")


def door_lines(group: dict) -> str:
    """Each door entry (hf_custom: the decoder through transformers' ``generate``) against the direct
    decoder with the same policy and settings: tokens/s, paired, and the prompts with the same tokens."""
    lines = []
    for e in group["entries"]:
        if "vs_direct" not in e:
            continue
        v = e["vs_direct"]
        if v is None:
            lines.append(f"- {e['method']} {e['tag']}: no direct {e['settings']['stop']} run with these settings in "
                         "this table (run both, interleaved: docs/infer.md, method hf_custom)")
            continue
        stop = e["settings"]["stop"]
        speed = (_ratio_cell(v, stop) if v["ratio"] is not None
                 else f"tokens/s not compared (untimed) with {stop} {v['tag']}")
        lines.append(f"- {e['method']} {e['tag']}: {speed}; the same tokens on {v['same_tokens']} of "
                     f"{v['n_compared']} prompts")
    if not lines:
        return ""
    return ("Through transformers' `generate` (custom_generate) against the direct decoder with the same policy "
            "(tokens/s ratio, paired 95% interval; output tokens compared prompt by prompt):\n\n" + "\n".join(lines))


def fit_line(group: dict) -> str:
    fit = group["fit"]
    if fit is None:
        return ("Cost model (Eq. 2.1): not fitted; it needs timed rows of our engine whose "
                "(N_draft, N_target) vary independently, e.g. target_only beside fixed_k runs.")
    line = (f"Cost model (Eq. 2.1, least squares over {fit['n_rows']} engine rows): "
            f"t_draft = {fit['t_draft'] * 1e3:.3f} ms, t_target = {fit['t_target'] * 1e3:.3f} ms, "
            f"R^2 = {fit['r2']:.3f}")
    if group.get("fit_problem"):  # specdecpp.analysis.costmodel.CostFit.problem
        return line + (f".\n\n> **Flagged, not used: {group['fit_problem']}.** The Eq. 2.3 columns are empty "
                       "where they would use these costs.")
    line += f"; t_draft / t_target = {fit['t_draft'] / fit['t_target']:.3f}."
    if group.get("fit_warning"):
        line += (f"\n\n> **Warning: R^2 = {fit['r2']:.2f} < {R2_WARNING}.** Constant per-forward costs do not "
                 "explain the measured times (on a CPU a verification of several tokens costs more than one), "
                 "so the Eq. 2.3 columns are rough; trust the measured tokens/s and the width-dependent column.")
    return line


def legend_line(group: dict) -> str:
    """The one line under a group's table (the definitions are in docs/infer.md)."""
    few = any(_few(ci, n) for e in group["entries"] for ci, n in
              [(e.get("speedup_ci95"), e.get("speedup_ci_n", 0)), (e.get("task_score_ci95"), e.get("task_n", 0)),
               *((v["ci95"], v.get("ci_n", 0)) for v in e.get("vs_best", {}).values()),
               *([(e["vs_eager"]["ci95"], e["vs_eager"].get("ci_n", 0))] if e.get("vs_eager") else []),
               *((v["ci95"], v.get("ci_n", 0)) for v in [e.get("vs_direct")] if v)])
    return LEGEND + (f" {FEW_NOTE}" if few else "")


def skipped_lines(skipped: list[dict], markdown: bool = True) -> str:
    """The notice of the result lines the report left out (each file and line), or '': a quoted
    markdown block for report.md, plain text (``markdown=False``) for the warning."""
    if not skipped:
        return ""
    n = len(skipped)
    quote, bold = ("> ", "**") if markdown else ("", "")
    return (f"{quote}{bold}Skipped {n} result line{'s' if n > 1 else ''}{bold}, not counted in any table (each is "
            f"one prompt fewer in its table):\n" + "\n".join(
                f"{quote}- `{s['file']}` line {s['line']}: {s['problem']}" for s in skipped))


def _slug(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "_".join(parts)).strip("-")


def report_costs(paths: str | Path | Sequence[str | Path] | None) -> list[Costs]:
    """The ``--costs`` files (``specdecpp.analysis.costmodel.load_costs``), each recording the fast path
    it was measured on (``infer.costs --fast``; none: eager) and, as ``meta["file"]``, its path; the
    report prices each group's Eq. 2.3 with t_target(n) by the file of the group's own fast path
    (``infer.summary.costs_by_fast``)."""
    if paths is None:
        return []
    out = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        costs = load_costs(path)
        if not costs.target_by_width:
            raise ValueError(f"costs file {str(path)!r} has no target_by_width curve, which the report's "
                             "t_target(n) column needs; measure it with `python -m infer.costs --costs-out FILE`")
        out.append(replace(costs, meta={**costs.meta, "file": str(path)}))
    return out


def _fast_name(fast: str | None) -> str:
    return f"fast={fast}" if fast else "eager (fast=null)"


def machine_line(group: dict) -> str:
    """The machine(s) the group's rows were decoded on."""
    found = group.get("machines") or {}
    if len(found) == 1:
        return f"Machine: {next(iter(found))}."
    return "Machines (rows decoded on each; timings across machines do not compare): " + "; ".join(
        f"{m} ({n} rows)" for m, n in found.items()) + "."


def baseline_line(group: dict) -> str:
    """What the group's speedups are over, and which measured costs its Eq. 2.3 with t_target(n) used."""
    base, fast = group.get("baseline"), group.get("fast")
    if base is None:
        line = (f"No target-only rows on this path ({_fast_name(fast)}): no measured speedup; run method=target_only "
                f"with fast={fast or 'null'} beside the others.")
    else:
        tps = f", {base['tokens_per_s']:.2f} tokens/s" if base.get("tokens_per_s") else ""
        line = (f"Speedups are over target-only on the same path: {_fast_name(fast)}, "
                f"{base['n_prompts']} prompts{tps}.")
    costs = group.get("costs")
    if costs:
        line += (f" Eq. 2.3 with t_target(n): costs measured {_fast_name(costs['fast'])} (`{costs['file']}`; "
                 f"t_draft {costs['t_draft'] * 1e3:.2f} ms, t_target {costs['t_target'] * 1e3:.2f} ms).")
    elif group.get("costs_missing"):
        line += (f" Eq. 2.3 with t_target(n): none of the costs files was measured {_fast_name(fast)}; add one "
                 f"(`python -m infer.costs{' --fast ' + fast if fast else ''} --costs-out FILE`, "
                 "then --costs ... FILE).")
    return line


def potentials_section(potentials: Sequence[tuple[str, str | Path]]) -> str:
    """The pairs side by side by the potential tool (no decoding): for each ``(label, directory of
    potential.json)``, its data, split, mean P (by depth for a feature draft), cost ratio and the
    tool's best line per policy (best fixed K, perfect heads with and without the lag, trained heads,
    SVIP, oracle) with its interval."""
    lines = ["## The pairs by the potential tool (no decoding)\n",
             "Each pair's labels replayed as speculative rounds (`python -m infer.potential`): Eq. 2.3 speedups "
             "at the pair's measured cost ratio, 95% bootstrap intervals over prompts.\n"]
    for label, directory in potentials:
        path = Path(directory) / "potential.json"
        if not path.is_file():
            raise ValueError(f"--potential {label}={directory}: no potential.json there "
                             "(python -m infer.potential DATA --out DIR writes it)")
        ctx = json.loads(path.read_text())["context"]
        by_depth = ctx.get("mean_p_acc_by_depth")
        depth = (", by depth " + " / ".join(f"{p:.3f}" for p in by_depth)) if by_depth else ""
        lines.append(f"### {label}\n")
        lines.append(f"`{ctx['data']}`, split {ctx['split']}: {ctx['prompts']} prompts, {ctx['positions']} positions, "
                     f"mean P {ctx['mean_p_acc']:.3f}{depth}; cost ratio {ctx['cost_ratio']:.3f} "
                     f"({ctx.get('cost_source', 'given')}).\n")
        lines += [f"- {b}" for b in ctx.get("best_lines", [])]
        lines.append("")
    return "\n".join(lines)


def build_report(results_dir: str | Path, out_dir: str | Path,
                 costs: str | Path | Sequence[str | Path] | None = None,
                 potentials: Sequence[tuple[str, str | Path]] = ()) -> dict:
    """Write report.md, summary.json and the PNGs into ``out_dir``; return paths and summaries.
    ``costs``: one costs.json or several, one per fast path (:func:`report_costs`). ``potentials``:
    ``(label, potential directory)`` pairs shown side by side (:func:`potentials_section`)."""
    skipped: list[dict] = []
    rows = read_result_dir(results_dir, skipped)
    if skipped:
        warnings.warn(skipped_lines(skipped, markdown=False), stacklevel=2)
    if not rows:
        raise ValueError(f"no readable result rows under {str(results_dir)!r}; " + skipped_lines(skipped, False))
    groups = summarize_results(rows, report_costs(costs))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections, images = [f"# Inference report: {results_dir}\n"], []
    if skipped:
        sections.append(skipped_lines(skipped) + "\n")
    for g in groups:
        slug = _slug(g["pair"], g["prompts"], g["sampling"], g["device"], *([f"fast-{g['fast']}"] if g["fast"] else []))
        pngs = [pareto_plot(g, out / f"pareto_{slug}.png"), throughput_plot(g, out / f"throughput_{slug}.png")]
        if any(e.get("lossy") for e in g["entries"]):
            pngs.append(quality_plot(g, out / f"quality_{slug}.png"))
        images += pngs
        sections += [
            f"## {g['pair']} / {g['prompts']} / {g['sampling']} / {g['device']}"
            + (f" / fast={g['fast']}" if g["fast"] else "") + "\n",
            f"draft `{g['draft']}`, target `{g['target']}`\n", machine_line(g) + "\n", baseline_line(g) + "\n",
            fit_line(g) + "\n", group_table(g) + "\n",
            legend_line(g) + "\n",
        ]
        if unscored_line(g, results_dir):
            sections.append(unscored_line(g, results_dir) + "\n")
        if eager_lines(g):
            sections.append(eager_lines(g) + "\n")
        if baseline_lines(g):
            sections.append(baseline_lines(g) + "\n")
        if door_lines(g):
            sections.append(door_lines(g) + "\n")
        if tree_lines(g):
            sections.append(tree_lines(g) + "\n")
        if g["greedy"] and not any(e["method"] == "oracle" for e in g["entries"]):
            sections.append("No oracle rows: add them with `python -m infer method=oracle sampling=greedy` "
                            "and the same pair, prompts and out.\n")
        sections += [f"![{p.stem}]({p.name})\n" for p in pngs]
    if potentials:
        sections.append(potentials_section(potentials))
    report = "\n".join(sections)
    (out / "report.md").write_text(report)
    (out / "summary.json").write_text(json.dumps(groups, indent=2) + "\n")
    return {"report": out / "report.md", "summary": out / "summary.json", "images": images,
            "groups": groups, "text": report, "skipped": skipped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m infer.report", description=__doc__.split("\n\n")[1])
    parser.add_argument("results_dir", help="a directory of result files (searched recursively) or one .jsonl file")
    parser.add_argument("--out", help="output directory (default reports/<name of results_dir>)")
    parser.add_argument("--costs", nargs="+", metavar="FILE",
                        help="costs.json with t_draft and target_by_width (python -m infer.costs --costs-out): "
                        "adds Eq. "
                        "2.3 with the width-dependent target cost; one file per fast path (infer.costs --fast B "
                        "records it), each pricing the tables of its own path")
    parser.add_argument("--potential", action="append", default=[], metavar="LABEL=DIR",
                        help="a pair's potential directory (python -m infer.potential --out DIR), shown beside the "
                        "others under LABEL (repeatable: the demo shows its plain and its feature pair)")
    args = parser.parse_args(argv)
    out = args.out or str(Path("reports") / (Path(args.results_dir).resolve().name or "results"))
    potentials = []
    for spec in args.potential:
        label, sep, directory = spec.rpartition("=")  # a label may hold "=" (pair=demo)
        if not sep or not label or not directory:
            parser.error(f"--potential {spec!r}: give LABEL=DIR")
        potentials.append((label, directory))
    try:
        result = build_report(args.results_dir, out, args.costs, potentials)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    print(result["text"])
    print(f"wrote {result['report']}, {result['summary']} and {len(result['images'])} PNG files")


if __name__ == "__main__":
    main()
