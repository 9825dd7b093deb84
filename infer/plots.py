"""PNG plots of one report group (matplotlib, Agg): the discard-rate / verification-rate Pareto
plane (the paper's Fig. 4) and throughput against the swept threshold or K."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .summary import DOOR_METHODS, policy_method, swept_key  # noqa: E402

STYLE = {"fixed_k": ("tab:blue", "o"), "svip": ("tab:green", "^"), "specdecpp": ("tab:red", "s"),
         "hf_assisted constant": ("tab:purple", "D"), "hf_assisted heuristic": ("tab:brown", "P"),
         "hf_assisted confidence": ("tab:pink", "v"), "target_only": ("black", "x"), "oracle": ("gold", "*"),
         "pearl": ("tab:orange", "h"), "sequoia": ("tab:cyan", "p"), "hf_custom": ("tab:olive", "d")}
HF_LINES = {"hf_assisted constant": "--", "hf_assisted heuristic": "-.", "hf_assisted confidence": (0, (5, 1, 1, 1))}


def _style(label: str, method: str) -> tuple[str, str]:
    return STYLE.get(label, STYLE.get(method, ("gray", ".")))


def series(entries: list[dict]) -> dict[str, list[dict]]:
    """Entries of one method that differ only in the swept setting, ordered by it."""
    out = defaultdict(list)
    for e in entries:
        swept = swept_key(e)
        rest = {k: v for k, v in e["settings"].items() if k != swept}
        label = e["method"] + (f" {Path(str(rest['head'])).name}" if "head" in rest else "")
        if e["method"] in DOOR_METHODS:  # e.g. "hf_custom specdecpp next_wrej1_d1"
            label = f"{e['method']} {rest['stop']}" + (f" {Path(str(rest['head'])).name}" if "head" in rest else "")
        elif e["method"] == "hf_assisted":
            label = f"hf_assisted {e['settings']['mode']}"
        elif e["method"] == "pearl" and rest.get("stop"):
            label += f" +{rest['stop']} h={rest.get('threshold'):g}"
        elif e["method"] == "cascade":
            policy = rest["policy"]
            stop = (f"k={policy['k']}" if rest["stop"] == "fixed_k" else
                    f"{Path(str(rest['head'])).name} h={policy['threshold']:g}" if rest["stop"] == "specdecpp" else
                    f"svip h={policy['threshold']:g}")
            label = f"cascade {rest['rule']} {stop} (lossy)"
        elif e["method"] == "svip" and (rest.get("c"), rest.get("max_candidates")) != (0.15, 40):
            label += f" c={rest.get('c'):g} max={rest.get('max_candidates')}"
        out[label].append(e)
    return dict(out)


def _point_label(e: dict) -> str:
    swept = swept_key(e)
    if policy_method(e) == "fixed_k":
        return f"k={e['settings']['k']}"
    if e["method"] == "pearl":
        return f"γ={e['settings']['gamma']}"
    if e["method"] == "sequoia":
        return f"n={e['settings']['tree_size']},d={e['settings']['tree_depth']}"
    if swept == "threshold":
        return f"h={e['settings']['threshold']:g}"
    return ""


def pareto_plot(group: dict, path: Path) -> Path:
    """Discard rate against verification rate; lower-left is better (both cost time)."""
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for label, items in series(group["entries"]).items():
        color, marker = _style(label, items[0]["method"])
        xs = [e["verification_rate"] for e in items]
        ys = [e["discard_rate"] for e in items]
        ax.plot(xs, ys, marker=marker, color=color, label=label, linestyle="-" if len(items) > 1 else "none",
                markersize=10 if items[0]["method"] == "oracle" else 6)
        for e, x, y in zip(items, xs, ys, strict=True):
            if _point_label(e):
                ax.annotate(_point_label(e), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("verification rate  N_target / N")
    ax.set_ylabel("discard rate  N_discarded / N")
    ax.set_title(f"{group['pair']} / {group['prompts']} / {group['sampling']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def throughput_plot(group: dict, path: Path) -> Path:
    """Measured tokens/s against the threshold (SpecDec++, SVIP) and against K (fixed K);
    target-only and HF assisted generation as horizontal reference lines."""
    fig, (ax_h, ax_k) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for label, items in series(group["entries"]).items():
        method = items[0]["method"]
        color, marker = _style(label, method)
        items = [e for e in items if e["tokens_per_s"] is not None]
        if not items:
            continue
        line = "--" if method in DOOR_METHODS else "-"  # a door beside its direct decoder
        if policy_method(items[0]) in ("specdecpp", "svip"):
            ax_h.plot([e["settings"]["threshold"] for e in items], [e["tokens_per_s"] for e in items],
                      marker=marker, color=color, label=label, linestyle=line)
        elif policy_method(items[0]) == "fixed_k":
            ax_k.plot([e["settings"]["k"] for e in items], [e["tokens_per_s"] for e in items],
                      marker=marker, color=color, label=label, linestyle=line)
        elif method == "pearl":  # against the block length gamma it ran with (auto: Theorem 1's)
            points = sorted((max(e["gamma_used"] or [0]), e["tokens_per_s"]) for e in items)
            ax_k.plot([g for g, _ in points], [t for _, t in points], marker=marker, color=color,
                      label=label + " (x: gamma)", linestyle="--")
        elif method == "sequoia":  # against the drafted nodes of its tree
            points = sorted((e["settings"]["tree_size"] - 1, e["tokens_per_s"]) for e in items)
            ax_k.plot([g for g, _ in points], [t for _, t in points], marker=marker, color=color,
                      label=label + " (x: tree nodes)", linestyle="-.")
        else:
            for ax in (ax_h, ax_k):
                ax.axhline(items[0]["tokens_per_s"], color=color, label=label, linestyle=HF_LINES.get(label, ":"))
    ax_h.set_xlabel("threshold h")
    ax_k.set_xlabel("candidate length K (PEARL: block length gamma; Sequoia: tree nodes)")
    ax_h.set_ylabel("tokens / s (measured)")
    for ax in (ax_h, ax_k):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{group['pair']} / {group['prompts']} / {group['sampling']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


QUALITY_MEASURES = (("target_logprob_per_token", "target log-lik / token"),
                    ("greedy_match", "greedy match"), ("task_score", None))
TASK_AXIS = {"humaneval": "HumanEval pass@1", "gsm8k": "GSM8K exact match"}


def quality_plot(group: dict, path: Path) -> Path:
    """Lossy methods (cascades, one line per rule over alpha) against the exact ones: one row per
    quality measure (the target's mean log-likelihood per token, except under greedy decoding where
    it is not the sampled distribution's; the share of tokens equal to the target's greedy choice;
    the task score where the prompts have one) against tokens/s and against target calls per token.
    Exact methods are the reference points."""
    tasks = {e.get("task") for e in group["entries"]} - {None}
    measures = [(key, label if key != "task_score" else TASK_AXIS.get(next(iter(tasks)), "task score"))
                for key, label in QUALITY_MEASURES
                if not (key == "target_logprob_per_token" and group["greedy"])
                and any(e.get(key) is not None for e in group["entries"])]
    fig, axes = plt.subplots(len(measures), 2, figsize=(12, 3.6 * len(measures)), squeeze=False)
    lossy_labels = [label for label, items in series(group["entries"]).items() if items[0].get("lossy")]
    lossy_color = {label: plt.cm.tab20(i % 20) for i, label in enumerate(lossy_labels)}  # one colour per series
    for row, (key, ylabel) in enumerate(measures):
        for ax, xkey, xlabel in ((axes[row][0], "tokens_per_s", "tokens/s (measured)"),
                                 (axes[row][1], "verification_rate", "target calls per token")):
            for label, items in series(group["entries"]).items():
                items = [e for e in items if e.get(key) is not None and e.get(xkey) is not None]
                if not items:
                    continue
                lossy = items[0].get("lossy")
                color, marker = _style(label, items[0]["method"])
                ax.plot([e[xkey] for e in items], [e[key] for e in items], marker=marker,
                        color=lossy_color[label] if lossy else color, linestyle="-" if lossy else "none", label=label,
                        alpha=1.0 if lossy else 0.6)
                if lossy:
                    for e in items:
                        ax.annotate(f"α={e['settings']['alpha']:g}", (e[xkey], e[key]), fontsize=7,
                                    textcoords="offset points", xytext=(3, 3))
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Quality against speed: lossy cascades beside the exact methods "
                 f"({group['prompts']}, {group['sampling']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
