"""Reliability diagram of a trained head (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_calibration(results: dict[str, dict], path: str | Path, title: str) -> Path:
    """Mean label against mean predicted acceptance per bin, one line per split, and the share of
    positions per bin below. ``results[split]`` holds ``calibration_bins`` and ``ECE``."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5.5, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    top.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    for split, values in results.items():
        bins = {k: np.asarray(v) for k, v in values["calibration_bins"].items()}
        used = bins["count"] > 0
        mean_prob = bins["sum_prob"][used] / bins["count"][used]
        mean_label = bins["sum_label"][used] / bins["count"][used]
        line = top.plot(mean_prob, mean_label, marker="o", label=f"{split} (ECE {values['ECE']:.3f})")[0]
        bottom.plot(mean_prob, bins["count"][used] / bins["count"].sum(), marker=".", color=line.get_color())
    top.set_ylabel("mean label P (acceptance prob.)")
    top.set_title(title)
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.legend(loc="upper left", fontsize=8)
    bottom.set_xlabel("predicted acceptance sigmoid(head)")
    bottom.set_ylabel("share of positions")
    fig.subplots_adjust(left=0.14, right=0.97, top=0.94, bottom=0.08, hspace=0.08)  # tight_layout: 2x the time
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
