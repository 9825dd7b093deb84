"""Aggregate result rows into report entries: one group per (pair, prompts, sampling), one entry
per (method, settings). Rates are pooled (sum over prompts / total N), so Eq. 2.3 with the pooled
rates predicts exactly total wall time / total N, the inverse of the measured throughput."""

from __future__ import annotations

import math
from collections import defaultdict

from specdecpp.metrics import CostFit, fit_cost_model, predicted_tokens_per_s

from .methods import METHODS

# Methods our engine runs: their rows feed the Eq. 2.1 regression (HF and the oracle do not).
ENGINE_METHODS = ("target_only", "fixed_k", "svip", "specdecpp")
# The swept parameter of each method: one plotted series per method and its other settings.
SWEPT = {"fixed_k": "k", "svip": "threshold", "specdecpp": "threshold", "hf_assisted": "mode"}


def sampling_label(s: dict) -> str:
    return "greedy" if s["temperature"] == 0 else f"T={s['temperature']:g}, top-k={s['top_k']}, top-p={s['top_p']:g}"


GROUP_KEYS = ("pair", "draft", "target", "device", "prompts", "sampling")


def group_rows(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows compared in one table: same pair, device, prompt set and sampling."""
    groups = defaultdict(list)
    for row in rows:
        key = (row["pair"]["name"], row["pair"]["draft"], row["pair"]["target"], row.get("device", "?"),
               row["prompts"]["name"], sampling_label(row["sampling"]))
        groups[key].append(row)
    return dict(sorted(groups.items()))


def fit_group(rows: list[dict]) -> CostFit | None:
    """Eq. 2.1 over the timed rows of our engine; None where the counts cannot separate the costs."""
    engine = [r for r in rows if r["method"] in ENGINE_METHODS and r.get("timed")]
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
    wall = sum(r["wall_time_s"] for r in rows) if timed else None
    dr = sum(r["n_discarded"] for r in rows) / n if n else math.nan
    vr = sum(r["n_target"] for r in rows) / n if n else math.nan
    pred = predicted_tokens_per_s(fit.t_draft, fit.t_target, dr, vr) if fit else None
    measured = n / wall if timed and wall else None
    forward = [r.get("forward_time_s") for r in rows]
    outside = 1.0 - sum(forward) / wall if wall and None not in forward else None
    return {
        "method": first["method"], "tag": first["tag"], "settings": first["settings"],
        "n_prompts": len(rows), "n_generated": n, "timed": timed,
        "tokens_per_s": measured, "predicted_tokens_per_s": pred,
        "measured_over_predicted": measured / pred if measured and pred else None,
        "outside_forward_share": outside,
        "mean_accept_length": sum(rounds) / len(rounds) if rounds and first["method"] != "target_only" else None,
        "discard_rate": dr, "verification_rate": vr,
        **{key: sum(r[key] for r in rows) if timed and None not in (r[key] for r in rows) else None
           for key in ("draft_time_s", "target_time_s")},  # None: not measured (CUDA without profile)
        "wall_time_s": wall,
    }


def _order(entry: dict) -> tuple:
    swept = entry["settings"].get(SWEPT.get(entry["method"], ""), "")
    return (METHODS.index(entry["method"]) if entry["method"] in METHODS else len(METHODS),
            str({k: v for k, v in entry["settings"].items() if k != SWEPT.get(entry["method"])}),
            swept if isinstance(swept, (int, float)) else 0, str(swept))


def summarize_group(rows: list[dict]) -> dict:
    fit = fit_group(rows)
    by_run = defaultdict(list)
    for row in rows:
        by_run[(row["method"], row["tag"], repr(sorted(row["settings"].items())))].append(row)
    entries = sorted((_entry(r, fit) for r in by_run.values()), key=_order)
    base = next((e for e in entries if e["method"] == "target_only"), None)
    for e in entries:
        e["speedup"] = e["speedup_predicted"] = None
        if base and e["tokens_per_s"] and base["tokens_per_s"]:
            e["speedup"] = e["tokens_per_s"] / base["tokens_per_s"]
        if base and e["predicted_tokens_per_s"] and base["predicted_tokens_per_s"]:
            e["speedup_predicted"] = e["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
    return {"fit": fit.to_dict() if fit else None, "entries": entries,
            "greedy": rows[0]["sampling"]["temperature"] == 0}


def summarize_results(rows: list[dict]) -> list[dict]:
    """One summary per (pair, prompts, sampling) group, as plain data."""
    return [{**dict(zip(GROUP_KEYS, key, strict=True)), **summarize_group(group)}
            for key, group in group_rows(rows).items()]
