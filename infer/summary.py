"""Aggregate result rows into report entries: one group per (pair, prompts, sampling), one entry
per (method, settings). Rates are pooled (sum over prompts / total N), so Eq. 2.3 with the pooled
rates predicts exactly total wall time / total N, the inverse of the measured throughput."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

from specdecpp.analysis.costmodel import (
    CostFit,
    Costs,
    batch_latency,
    fit_cost_model,
    latency_by_width,
    predicted_tokens_per_s,
)
from specdecpp.analysis.stats import bootstrap_interval, paired_ratio_interval
from specdecpp.models.identity import model_key

from .methods import METHODS
from .results import pooled_wall
from .tags import rounds_suffix

# Methods our engine runs: their rows feed the Eq. 2.1 regression (HF and the oracle do not).
ENGINE_METHODS = ("target_only", "fixed_k", "svip", "specdecpp")
# The swept parameter of each method: one plotted series per method and its other settings.
SWEPT = {"fixed_k": "k", "svip": "threshold", "specdecpp": "threshold", "pearl": "gamma", "hf_assisted": "mode",
         "sequoia": "tree_size", "cascade": "alpha"}
# The direct decoder through transformers' ``generate`` (custom_generate): settings {"stop": <its
# policy's method>, **that method's settings}; swept and compared as that method.
DOOR_METHODS = ("hf_custom",)
# Methods whose two models run at once: Eq. 2.3 (a sum of sequential forward costs) does not apply.
CONCURRENT_METHODS = ("pearl",)
# Token trees: a draft forward feeds a level of several nodes, so Eq. 2.3's constant t_draft per
# forward does not apply; their prediction is the width one (t_draft(m) per level, t_target(n) per round).
TREE_METHODS = ("sequoia",)


def sampling_label(s: dict) -> str:
    return "greedy" if s["temperature"] == 0 else f"T={s['temperature']:g}, top-k={s['top_k']}, top-p={s['top_p']:g}"


GROUP_KEYS = ("pair", "draft", "target", "device", "prompts", "sampling", "batch_size", "fast")


def group_rows(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows compared in one table: same pair, device, prompt set, sampling, batch size (a batched
    method against target-only at the same batch size) and fast path (a fast method against fast
    target-only; ``fast`` None: eager). A pair's models are compared as
    :func:`~specdecpp.models.identity.model_key` names them: two paths to one directory are one model."""
    groups, models = defaultdict(list), {}

    def model_of(ref):
        if ref is not None and ref not in models:
            models[ref] = model_key(ref)
        return models.get(ref)

    for row in rows:
        key = (row["pair"]["name"], *(model_of(row["pair"][k]) for k in ("draft", "target")), row.get("device", "?"),
               row["prompts"]["name"], sampling_label(row["sampling"]), row.get("batch_size", 1), row.get("fast") or "")
        groups[key].append(row)
    return dict(sorted(groups.items()))


def fit_group(rows: list[dict]) -> CostFit | None:
    """Eq. 2.1 over the timed rows of our engine; None where the counts cannot separate the costs."""
    engine = [r for r in rows if r["method"] in ENGINE_METHODS and r.get("timed") and r.get("batch_id") is None]
    try:
        return fit_cost_model([r["n_draft"] for r in engine], [r["n_target"] for r in engine],
                              [r["wall_time_s"] for r in engine])
    except ValueError:
        return None


def _entry(rows: list[dict], fit: CostFit | None) -> dict:
    first = rows[0]
    n = sum(r["n_generated"] for r in rows)
    rounds = [a for r in rows for a in r["accept_lengths"]]
    timed = all(r.get("timed") for r in rows)
    wall = pooled_wall(rows) if timed else None
    dr = sum(r["n_discarded"] for r in rows) / n if n else math.nan
    vr = sum(r["n_target"] for r in rows) / n if n else math.nan
    concurrent = first["method"] in CONCURRENT_METHODS
    constant = fit and not concurrent and first["method"] not in TREE_METHODS
    pred = predicted_tokens_per_s(fit.t_draft, fit.t_target, dr, vr) if constant else None
    measured = n / wall if timed and wall else None
    forward = [r.get("forward_time_s") for r in rows]
    outside = 1.0 - sum(forward) / wall if wall and None not in forward else None
    return {
        "method": first["method"], "tag": run_tag(first),
        "settings": first["settings"],
        "n_prompts": len(rows), "n_generated": n, "timed": timed,
        "tokens_per_s": measured, "predicted_tokens_per_s": pred,
        "measured_over_predicted": measured / pred if measured and pred else None,
        "outside_forward_share": outside,
        "mean_accept_length": sum(rounds) / len(rounds) if rounds and first["method"] != "target_only" else None,
        "discard_rate": dr, "verification_rate": vr,
        **{key: sum(r[key] for r in rows) if timed and None not in (r[key] for r in rows) else None
           for key in ("draft_time_s", "target_time_s")},  # None: not measured (CUDA without profile)
        "wall_time_s": wall,
        # PEARL: the share of the wall time both models were busy at once, and the gamma(s) it ran with
        "both_busy_share": sum(r["overlap_time_s"] for r in rows) / wall if concurrent and wall else None,
        "gamma_used": sorted({r.get("gamma_used") for r in rows}) if concurrent else None,
        # token trees: tokens per target call, against the DP's G(n, d) for the tree (when it was chosen by it)
        "tokens_per_target_call": n / sum(r["n_target"] for r in rows) if first["method"] in TREE_METHODS else None,
        # lossy methods (cascades) are judged by their quality beside the exact ones (the reference)
        "lossy": any(r.get("lossy") for r in rows),
        **{key: _mean(r.get(key) for r in rows) for key in ("target_logprob_per_token", "greedy_match")},
        **task_summary(rows),
    }


def task_summary(rows: list[dict]) -> dict:
    """The mean task score over prompts (HumanEval: pass@1 with one sample per problem; GSM8K: exact
    match) with a 95% bootstrap interval over prompts; None where the rows have no task.
    ``task_unscored``: rows with a task but no score (HumanEval where code execution was not allowed)."""
    tasks = sorted({r.get("task") for r in rows} - {None})
    if len(tasks) > 1:
        raise ValueError(f"rows of {rows[0]['method']} {rows[0]['tag']} mix task scores {tasks} in one group")
    scores = np.array([r["task_score"] for r in rows if r.get("task_score") is not None], dtype=float)
    if not tasks:
        return {"task": None, "task_score": None, "task_score_ci95": None, "task_n": 0}
    unscored = sum(r.get("task") is not None and r.get("task_score") is None for r in rows)  # code not allowed to run
    if not len(scores):
        return {"task": tasks[0], "task_score": None, "task_score_ci95": None, "task_n": 0, "task_unscored": unscored}
    mean = float(scores.mean())
    if len(scores) < 2:
        ci = None
    elif np.all(scores == scores[0]):  # no spread: every resample has the same mean
        ci = (mean, mean)
    else:
        ci = bootstrap_interval(np.mean, scores)
    return {"task": tasks[0], "task_score": mean, "task_score_ci95": ci, "task_n": len(scores),
            "task_unscored": unscored}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def policy_method(entry: dict) -> str:
    """The method whose stop policy an entry runs: its own, or a door's (hf_custom: its ``stop``)."""
    return entry["settings"].get("stop", "") if entry["method"] in DOOR_METHODS else entry["method"]


def swept_key(entry: dict) -> str | None:
    """The setting an entry's series is swept over (:data:`SWEPT`; a door's: its policy's)."""
    return SWEPT.get(policy_method(entry))


def _order(entry: dict) -> tuple:
    key = swept_key(entry)
    swept = entry["settings"].get(key or "", "")
    return (METHODS.index(entry["method"]) if entry["method"] in METHODS else len(METHODS),
            str({k: v for k, v in entry["settings"].items() if k != key}),
            swept if isinstance(swept, (int, float)) else 0, str(swept))


R2_WARNING = 0.9  # below this the constant-cost model (Eq. 2.1) does not explain the measured times


def width_latency(rows: list[dict], costs: Costs) -> float | None:
    """Seconds per token predicted with a width-dependent target cost (``specdecpp.analysis.costmodel``):
    t_draft * N_draft plus, per round, t_target(K + 1) for a verification of K candidates. Rows
    that record their draft forwards' widths (token trees) cost t_draft(m) per forward of m tokens
    where costs.json has the draft's curve."""
    if not costs.target_by_width or any("candidate_lengths" not in r for r in rows):
        return None
    n = sum(r["n_generated"] for r in rows)
    widths = Counter(k for r in rows for k in r["candidate_lengths"])
    verification = costs.verification_cost(widths)
    if costs.draft_by_width and all("draft_widths" in r for r in rows):
        draft = sum(c * costs.draft_cost(int(w)) for r in rows for w, c in r["draft_widths"].items())
        return (draft + verification) / n if n else None
    return latency_by_width(costs, n, sum(r["n_draft"] for r in rows), verification) if n else None


def calls(rows: list[dict]) -> dict[str, dict]:
    """Batched rows by their ``generate_batch`` call: tokens, the call's wall time and rounds."""
    out: dict[str, dict] = {}
    for r in rows:
        call = out.setdefault(r["batch_id"], {"tokens": 0, "wall_time_s": r["batch_wall_time_s"],
                                              "rounds": r.get("batch_rounds")})
        call["tokens"] += r["n_generated"]
    return out


def batch_latency_of(rows: list[dict], costs: Costs) -> float | None:
    """Seconds per token Eq. 2.1 predicts for batched rows with the measured t_draft(B) and
    t_target(B, n) (``costs.json``'s draft_by_batch / target_by_batch; ``costmodel.batch_latency``
    per call: per round K_max * t_draft(B) + t_target(B, K_max + 1)); None without those curves or
    without the calls' recorded rounds."""
    if not costs.target_by_batch:
        return None
    by_call = calls(rows)
    if any(c["rounds"] is None for c in by_call.values()):
        return None
    n = sum(c["tokens"] for c in by_call.values())
    return sum(batch_latency(costs, [tuple(r) for r in c["rounds"]]) for c in by_call.values()) / n if n else None


def paired_units(rows: list[dict], base_rows: list[dict]) -> list[tuple]:
    """What :func:`paired_speedup_ci` resamples: (tokens, wall time) of both runs per prompt timed
    in both, or per ``generate_batch`` call for batched rows (which share their call's time)."""
    if any(r.get("batch_id") is not None for r in rows):
        mine, theirs = calls([r for r in rows if r.get("timed")]), calls([r for r in base_rows if r.get("timed")])
        units = [(mine[c]["tokens"], mine[c]["wall_time_s"], theirs[c]["tokens"], theirs[c]["wall_time_s"])
                 for c in sorted(set(mine) & set(theirs))]
    else:
        by_id = {r["prompt_id"]: r for r in rows if r.get("timed")}
        base = {r["prompt_id"]: r for r in base_rows if r.get("timed")}
        units = [(by_id[i]["n_generated"], by_id[i]["wall_time_s"], base[i]["n_generated"], base[i]["wall_time_s"])
                 for i in sorted(set(by_id) & set(base))]
    return units


def paired_speedup_ci(rows: list[dict], base_rows: list[dict], n_boot: int = 1000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float] | None:
    """95% bootstrap interval (``specdecpp.analysis.stats``) of tokens/s(rows) / tokens/s(base_rows) over
    prompts resampled with replacement, the same prompts for both (pooled: sum of tokens / sum of
    wall time); None with fewer than two prompts timed in both. Batched rows share their call's
    time, so there the unit is the call (``batch_id``: the same prompts in both)."""
    units = paired_units(rows, base_rows)
    if len(units) < 2:
        return None
    cols = np.array(units, dtype=float).T
    return paired_ratio_interval(*cols, n_resamples=n_boot, seed=seed, level=level)


BASELINES = ("fixed_k", "svip")  # what a learned stop policy must beat (issue 24): each one's best setting


def _run_key(entry: dict) -> tuple:
    return (entry["method"], entry["tag"], repr(sorted(entry["settings"].items())))


def _batching(rows: list[dict]) -> tuple:
    return (rows[0].get("batch_size", 1), bool(rows[0].get("batch_fill")))


def add_best_baseline_ratios(entries: list[dict], by_run: dict) -> None:
    """Each timed entry's tokens/s over the fastest timed setting of each baseline method (fixed K,
    SVIP) at the same batching, with a paired 95% bootstrap interval over prompts (the same
    resampled prompts for both): ``entry["vs_best"][method] = {"tag", "ratio", "ci95"}``. The best
    setting is picked on these same prompts, which favours the baseline (a conservative test for the
    challenger)."""
    def batching(e):
        return _batching(by_run[_run_key(e)])

    for e in entries:
        e["vs_best"] = {}
    for method in BASELINES:
        for layout in {batching(e) for e in entries}:
            pool = [e for e in entries if e["method"] == method and e["timed"] and e["tokens_per_s"]
                    and batching(e) == layout]
            if not pool:
                continue
            best = max(pool, key=lambda e: e["tokens_per_s"])
            for e in entries:
                if e is best or not (e["timed"] and e["tokens_per_s"]) or e["method"] == "target_only" \
                        or batching(e) != layout:
                    continue
                mine, theirs = by_run[_run_key(e)], by_run[_run_key(best)]
                e["vs_best"][method] = {"tag": best["tag"], "ratio": e["tokens_per_s"] / best["tokens_per_s"],
                                        "ci95": paired_speedup_ci(mine, theirs),
                                        "ci_n": len(paired_units(mine, theirs))}


def add_door_ratios(entries: list[dict], by_run: dict) -> None:
    """Each door entry (:data:`DOOR_METHODS`) against the direct decoder with the same policy and
    settings in the same table, if there is one: ``entry["vs_direct"] = {"tag", "ratio" (tokens/s
    over the direct's), "ci95" (paired over prompts), "ci_n", "same_tokens", "n_compared"}`` (the
    prompts decoded by both whose output tokens are equal, of those decoded by both); else None."""
    for e in entries:
        if e["method"] not in DOOR_METHODS:
            continue
        settings = {k: v for k, v in e["settings"].items() if k != "stop"}
        direct = next((d for d in entries if d["method"] == policy_method(e) and d["settings"] == settings), None)
        e["vs_direct"] = None
        if direct is None:
            continue
        mine, theirs = by_run[_run_key(e)], by_run[_run_key(direct)]
        tokens = {r["prompt_id"]: r["output_ids"] for r in theirs}
        both = [r for r in mine if r["prompt_id"] in tokens]
        timed = e["tokens_per_s"] and direct["tokens_per_s"]
        e["vs_direct"] = {"tag": direct["tag"], "ratio": e["tokens_per_s"] / direct["tokens_per_s"] if timed else None,
                          "ci95": paired_speedup_ci(mine, theirs) if timed else None,
                          "ci_n": len(paired_units(mine, theirs)),
                          "same_tokens": sum(r["output_ids"] == tokens[r["prompt_id"]] for r in both),
                          "n_compared": len(both)}


def run_tag(row: dict) -> str:
    """A row's method tag in the report: ``+fill`` for filled batches, ``+fused`` / ``+per-forward``
    for rounds decoded other than captured plain (infer's ``capture_rounds``)."""
    return (row["tag"] + ("+fill" if row.get("batch_fill") else "")
            + rounds_suffix(row.get("capture_rounds", True), "+"))


def target_only_entry(entries: list[dict]) -> dict | None:
    """The group's target-only entry, the baseline: rounds captured as by default where there are
    several (a ``capture_rounds`` variant beside it)."""
    bases = [e for e in entries if e["method"] == "target_only"]
    return next((e for e in bases if not e["tag"].endswith(("+fused", "+per-forward"))), bases[0] if bases else None)


def runs(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows by run (:func:`_run_key` of their entry): method, settings, and (batches) whether rows
    filled the round."""
    by_run = defaultdict(list)
    for row in rows:
        by_run[(row["method"], run_tag(row), repr(sorted(row["settings"].items())))].append(row)
    return by_run


def add_eager_ratios(entries: list[dict], rows: list[dict], eager_rows: list[dict]) -> None:
    """Each timed fast entry's tokens/s over the same method's (same settings') eager run, with the
    paired 95% bootstrap interval over the prompts timed in both: ``entry["vs_eager"] = {"ratio",
    "ci95", "ci_n"}``, None where the table of eager rows has no such run."""
    mine, eager = runs(rows), runs(eager_rows)
    for e in entries:
        theirs = eager.get(_run_key(e))
        e["vs_eager"] = None
        if theirs and e["tokens_per_s"] and all(r.get("timed") for r in theirs):
            ratio = e["tokens_per_s"] / (sum(r["n_generated"] for r in theirs) / pooled_wall(theirs))
            e["vs_eager"] = {"ratio": ratio, "ci95": paired_speedup_ci(mine[_run_key(e)], theirs),
                             "ci_n": len(paired_units(mine[_run_key(e)], theirs))}


def costs_by_fast(costs: Costs | Sequence[Costs] | None) -> dict[str | None, Costs]:
    """The measured costs by the fast path they were measured on (``meta["fast"]``, written by
    ``python -m infer.costs [--fast B]``; a file without it is eager): a group's Eq. 2.3 with
    t_target(n) is priced with the costs of its own ``fast`` only. Two files of one ``fast`` are
    refused, naming both."""
    out: dict[str | None, Costs] = {}
    for c in [costs] if isinstance(costs, Costs) else list(costs or ()):
        fast = c.meta.get("fast") or None
        if fast in out:
            raise ValueError(f"two costs files measured with fast={fast}: {out[fast].meta.get('file', '?')} and "
                             f"{c.meta.get('file', '?')}; give one per fast path")
        out[fast] = c
    return out


def baseline_of(base: dict | None, fast: str | None) -> dict | None:
    """What a group's speedups are taken over: its target-only entry ``base`` (the group's rows
    share one ``fast``, so a fast method is compared with fast target-only, an eager one with eager)."""
    if base is None:
        return None
    return {"method": "target_only", "tag": base["tag"], "fast": fast, "tokens_per_s": base["tokens_per_s"],
            "n_prompts": base["n_prompts"]}


def costs_summary(costs: Costs | None) -> dict | None:
    if costs is None:
        return None
    return {"fast": costs.meta.get("fast") or None, "file": costs.meta.get("file"),
            "measured_by": costs.meta.get("measured_by"), "t_draft": costs.t_draft, "t_target": costs.t_target}


def machines(rows: list[dict]) -> dict[str, int]:
    """The machines the rows were decoded on (``machine`` of a row, ``specdecpp.core.timing.
    machine_description``; rows written before it was recorded: '?'), with their row counts."""
    return dict(Counter(r.get("machine") or "?" for r in rows).most_common())


def summarize_group(rows: list[dict], costs: Costs | None = None) -> dict:
    fit = fit_group(rows)
    problem = fit.problem if fit else None  # a cost that is not positive: shown, flagged, not used
    usable = None if problem else fit
    by_run = runs(rows)
    entries = sorted((_entry(r, usable) for r in by_run.values()), key=_order)
    base = target_only_entry(entries)
    base_rows = by_run.get(_run_key(base)) if base else None
    batched = rows[0].get("batch_size", 1) > 1
    # Eq. 2.3 with the measured width (batch 1: t_target(n); batches: t_draft(B), t_target(B, n))
    latency_of = batch_latency_of if batched else width_latency
    base_width = latency_of(base_rows, costs) if costs and base_rows else None
    for e in entries:
        e_rows = by_run[_run_key(e)]
        e["speedup"] = e["speedup_predicted"] = e["speedup_ci95"] = e["speedup_width_predicted"] = None
        e["speedup_ci_n"] = 0  # the prompts (batches: calls) the interval was bootstrapped from
        if base and e["tokens_per_s"] and base["tokens_per_s"]:
            e["speedup"] = e["tokens_per_s"] / base["tokens_per_s"]
            e["speedup_ci95"] = paired_speedup_ci(e_rows, base_rows)
            e["speedup_ci_n"] = len(paired_units(e_rows, base_rows))
        if base and e["predicted_tokens_per_s"] and base["predicted_tokens_per_s"]:
            e["speedup_predicted"] = e["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
        if base_width and e["method"] not in CONCURRENT_METHODS:
            latency = latency_of(e_rows, costs)
            e["speedup_width_predicted"] = base_width / latency if latency else None
    add_best_baseline_ratios(entries, by_run)
    add_door_ratios(entries, by_run)
    return {"fit": fit.to_dict() if fit else None, "entries": entries, "fit_problem": problem,
            "fit_warning": bool(usable and not usable.r2 >= R2_WARNING),
            "greedy": rows[0]["sampling"]["temperature"] == 0,
            "baseline": baseline_of(base, rows[0].get("fast") or None), "costs": costs_summary(costs),
            "machines": machines(rows)}


def summarize_results(rows: list[dict], costs: Costs | Sequence[Costs] | None = None) -> list[dict]:
    """One summary per (pair, device, prompts, sampling, batch size, fast) group, as plain data.
    ``costs`` (``specdecpp.analysis.costmodel.Costs`` with target_by_width, or several, one per fast
    path: :func:`costs_by_fast`) adds Eq. 2.3 with the width-dependent target cost to the groups of
    the same ``fast``; ``costs_missing`` marks a group that costs were given for, but none of its
    fast path. A fast group beside its eager one gets each method's ratio over its eager self
    (:func:`add_eager_ratios`)."""
    by_fast, groups = costs_by_fast(costs), group_rows(rows)
    out = []
    for key, group in groups.items():
        fast = key[-1] or None
        summary = summarize_group(group, by_fast.get(fast))
        if fast and key[:-1] + ("",) in groups:  # the same table's eager rows: each method fast over eager
            add_eager_ratios(summary["entries"], group, groups[key[:-1] + ("",)])
        out.append({**dict(zip(GROUP_KEYS, key, strict=True)), "fast": fast, **summary,
                    "costs_missing": bool(by_fast) and fast not in by_fast})
    return out
