"""The what-if grid of ``python -m infer.potential DATA --whatif-gammas ...`` (docs/potential.md,
"How much better must my draft be?").

For each gamma, every label P_i of the dataset is replaced by P_i ** gamma (gamma < 1 raises the
acceptances while keeping their order and their spread across positions: an easy position stays
easier than a hard one), and for each cost ratio c the potential simulator (the same Bernoulli(P_i)
rounds, common random numbers) gives Eq. 2.3 speedups of the best fixed K, the informed Algorithm 2
(a perfect head with the paper's one-candidate lag), the same perfect head without the lag, and the
hindsight oracle, each at its best threshold (``specdecpp.analysis.potential.whatif_grid``). The table has
the informed margins over the best fixed K for every (mean acceptance, c); whatif.md, whatif.json
and whatif.png go to the output directory.

This is a model of a better draft, not a measurement: a real draft that accepts more would also
change which positions are hard. It answers "is my pair anywhere near the regime where stopping
matters?", and how far the demo pair is from it.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdecpp.analysis import potential as pt

DEFAULT_GAMMAS = (1.0, 0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05)


def table(records: list[dict]) -> str:
    lines = ["| mean P | cost ratio | best fixed K | informed (lag) | margin | perfect, no lag | margin | "
             "oracle margin |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        fk, inf, lf = r["fixed_k"], r["informed"], r["informed_lag_free"]
        lines.append(f"| {r['mean_acceptance']:.3f} | {r['cost_ratio']:.3f} | {fk['setting']}: {fk['speedup']:.3f}x "
                     f"| {inf['setting']}: {inf['speedup']:.3f}x | {inf['margin']:+.1%} "
                     f"| {lf['setting']}: {lf['speedup']:.3f}x | {lf['margin']:+.1%} | {r['oracle']['margin']:+.1%} |")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for c in sorted({r["cost_ratio"] for r in records}, reverse=True):
        rs = sorted((r for r in records if r["cost_ratio"] == c), key=lambda r: r["mean_acceptance"])
        x = [r["mean_acceptance"] for r in rs]
        line, = ax.plot(x, [100 * r["informed"]["margin"] for r in rs], "o-", label=f"informed, c={c:g}")
        ax.plot(x, [100 * r["informed_lag_free"]["margin"] for r in rs], "s--", color=line.get_color(),
                alpha=0.6, label=f"no lag, c={c:g}")
    ax.axhline(8, color="grey", lw=0.8, ls=":")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("mean acceptance probability (labels raised to a power gamma)")
    ax.set_ylabel("margin over the best fixed K, Eq. 2.3 (%)")
    ax.set_title("Perfect stop heads vs fixed K as the draft improves")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(rows: list[dict], data: str, split: str, gammas, ratios, out: str | Path, seeds: int = 5,
        max_k: int = 10, quiet: bool = False) -> list[dict]:
    """The grid over ``rows`` (``infer.potential.dataset_rows``), written to ``out``."""
    if not ratios:
        raise ValueError("the what-if grid needs a cost ratio: --costs FILE, --cost-ratio R or --whatif-ratios R ...")
    records = pt.whatif_grid(rows, gammas, ratios, seeds=seeds, max_k=max_k)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(records)
    (out / "whatif.json").write_text(json.dumps(records, indent=1) + "\n")
    (out / "whatif.md").write_text(f"# What-if: {data} ({split}), labels P ** gamma\n\n{text}\n")
    plot(records, out / "whatif.png")
    if not quiet:
        print(text)
        print(f"wrote {out / 'whatif.md'}, whatif.json, whatif.png")
    return records
