"""How far would a longer build take the demo feature draft? A saturating power law fitted to the first
session's held-out acceptance curve (docs/results/feature_draft.md, "Training so far"), extrapolated.

    python research/feature_draft_scaling/fit.py      # prints the fit, writes fit.json and fit.png here

The curve is one run over 184k distinct positions (five passes by step 600), so it mixes more data with
more passes over the same data: read the ceiling as an optimistic bound for that data, not a law."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.optimize import curve_fit

HERE = Path(__file__).parent
# step, positions seen, held-out alpha_1 (T=1, top-k 50; bundled dev answers)
CURVE = [(100, 171_900, 0.224), (200, 327_473, 0.288), (300, 483_910, 0.339), (400, 628_117, 0.357),
         (500, 773_563, 0.377), (600, 918_925, 0.385)]
POSITIONS_PER_S = 45.0  # the data stage on one core of this CPU (sampling the target's answers)
TRAIN_POSITIONS_PER_S = 215.0  # training, one thread (140-290 measured)


def law(n, a, b, c):
    return a - b * (n / 1e5) ** (-c)


def main() -> None:
    n = np.array([p for _, p, _ in CURVE], dtype=float)
    alpha = np.array([a for _, _, a in CURVE])
    (a, b, c), cov = curve_fit(law, n, alpha, p0=(0.45, 0.3, 0.8), maxfev=20000)
    err = np.sqrt(np.diag(cov))
    out = {"ceiling_alpha1": float(a), "ceiling_se": float(err[0]), "b": float(b), "c": float(c),
           "at_positions": {}}
    for target in (0.40, 0.42, 0.45, 0.50, 0.65):
        if target >= a:
            out["at_positions"][str(target)] = None
            continue
        need = 1e5 * (b / (a - target)) ** (1 / c)
        hours = need / TRAIN_POSITIONS_PER_S / 3600
        out["at_positions"][str(target)] = {"positions_seen": float(need), "train_hours_one_thread": float(hours)}
    (HERE / "fit.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.geomspace(1e5, 1e8, 200)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(n, alpha, "o", label="held-out alpha_1 (measured)")
    ax.plot(grid, law(grid, a, b, c), "-", label=f"fit: ceiling {a:.3f} +/- {err[0]:.3f}")
    ax.axhline(0.65, ls="--", c="gray", label="issue 62's 0.65 (mean P)")
    ax.set_xscale("log")
    ax.set_xlabel("training positions seen")
    ax.set_ylabel("alpha_1")
    ax.set_title("demo feature draft: acceptance against positions seen")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "fit.png", dpi=120)


if __name__ == "__main__":
    main()
