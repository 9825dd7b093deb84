"""What a finished dataset looks like: a table of label statistics and a PNG, written beside it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from datasets import DatasetDict
from rich.console import Console
from rich.table import Table

from specdecpp.data.dataset import label_summary

SUMMARY_JSON = "summary.json"
SUMMARY_PNG = "summary.png"


def print_summary(summary: dict[str, dict], title: str) -> None:
    table = Table(title=title)
    for column in ("split", "rows", "tokens", "mean length", "mean p_acc", "p_acc = 1", "p_acc = 0",
                   "mean H(q)"):
        table.add_column(column, justify="right")
    for split, s in summary.items():
        table.add_row(split, str(s["rows"]), str(s["tokens"]), f"{s['mean_length']:.1f}", f"{s['mean_p_acc']:.3f}",
                      f"{s['share_p_acc_1']:.1%}", f"{s['share_p_acc_0']:.1%}", f"{s['mean_draft_entropy']:.2f}")
    Console().print(table)


def _flat(split, column: str) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.list_flatten(split.with_format("arrow")[:][column]).to_numpy(zero_copy_only=False)


def plot_labels(splits: DatasetDict, path: Path, title: str) -> None:
    """Left: histogram of p_acc. Right: mean p_acc by draft-entropy decile (what SVIP relies on)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p_acc, entropy = (np.concatenate([_flat(d, column) for d in splits.values()])
                      for column in ("p_acc", "draft_entropy"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.hist(p_acc, bins=20, range=(0, 1))
    left.set(xlabel="p_acc = min(1, p/q)", ylabel="draft tokens", title="labels")
    if len(p_acc):
        edges = np.unique(np.quantile(entropy, np.linspace(0, 1, 11)))
        which = np.clip(np.searchsorted(edges, entropy, side="right") - 1, 0, max(len(edges) - 2, 0))
        centers = [entropy[which == b].mean() for b in range(max(len(edges) - 1, 1)) if (which == b).any()]
        means = [p_acc[which == b].mean() for b in range(max(len(edges) - 1, 1)) if (which == b).any()]
        right.plot(centers, means, "o-")
    right.set(xlabel="draft entropy H(q), nats", ylabel="mean p_acc", ylim=(0, 1),
              title="acceptance by draft entropy (deciles)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_summary(splits: DatasetDict, out: Path, title: str) -> dict[str, dict]:
    """Print the table, write summary.json and summary.png into ``out``; return the summary."""
    summary = label_summary(splits)
    print_summary(summary, title)
    (out / SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    plot_labels(splits, out / SUMMARY_PNG, title)
    return summary
