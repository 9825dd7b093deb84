"""How much better must the draft be for learned stopping to pay off? A what-if grid over the stop
potential of one data_gen dataset (docs/potential.md, "How much better must my draft be?").

    python scripts/potential_whatif.py data/demo/heldout_bundled --split test \
        --costs reports/bench/costs.json --ratios 0.08 0.04 --out reports/whatif/bundled   # make potential

For each gamma, every label P_i of the dataset is replaced by P_i ** gamma (gamma < 1 raises the
acceptances while keeping their order and their spread across positions: an easy position stays
easier than a hard one), and for each cost ratio c the simulator of ``python -m infer.potential``
(the same Bernoulli(P_i) rounds, common random numbers, 5 seeds) gives Eq. 2.3 speedups of the best
fixed K (1..10), the informed Algorithm 2 (a perfect head with the paper's one-candidate lag), the
same perfect head without the lag, and the hindsight oracle, each at its best threshold. The table
has the informed margins over the best fixed K for every (mean acceptance, c); whatif.md,
whatif.json and whatif.png go to --out.

This is a model of a better draft, not a measurement: a real draft that accepts more would also
change which positions are hard. It answers "is my pair anywhere near the regime where stopping
matters?", and how far the demo pair is from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specdecpp import potential as pt

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def transformed(rows: list[dict], gamma: float) -> list[dict]:
    """The rows with every acceptance probability raised to ``gamma`` (1 leaves them unchanged)."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    return [{**r, "p_acc": np.power(r["p_acc"], gamma)} for r in rows]


def grid(rows: list[dict], gammas: list[float], ratios: list[float], seeds: int = 5, max_k: int = 10) -> list[dict]:
    """One record per (gamma, ratio): mean acceptance and the best speedup of each policy family."""
    families = {"fixed_k": [pt.fixed_k(k) for k in range(1, max_k + 1)],
                "informed": [pt.informed(h) for h in THRESHOLDS],
                "informed_lag_free": [pt.informed_lag_free(h) for h in THRESHOLDS],
                "oracle": [pt.oracle()]}
    policies = [p for group in families.values() for p in group]
    records = []
    for gamma in gammas:
        rows_g = transformed(rows, gamma)
        counts = pt.simulate(rows_g, policies, seeds=range(seeds))
        totals = {p.label: pt._sum(counts[p.label]) for p in policies}
        mean_p = float(np.concatenate([r["p_acc"] for r in rows_g]).mean())
        for c in ratios:
            rec = {"gamma": gamma, "mean_acceptance": mean_p, "cost_ratio": c}
            for family, group in families.items():
                speed = {p.label: pt.speedup_eq23(totals[p.label], c) for p in group}
                best_label = max(speed, key=speed.get)
                rec[family] = {"speedup": speed[best_label], "setting": best_label}
            base = rec["fixed_k"]["speedup"]
            for family in ("informed", "informed_lag_free", "oracle"):
                rec[family]["margin"] = rec[family]["speedup"] / base - 1.0
            records.append(rec)
    return records


def table(records: list[dict]) -> str:
    lines = ["| mean P | cost ratio | best fixed K | informed (lag) | margin | perfect, no lag | margin | oracle margin |",
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


def main(argv: list[str] | None = None) -> None:
    from infer.potential import dataset_rows

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="a data_gen output directory")
    ap.add_argument("--split", default="test")
    ap.add_argument("--gammas", type=float, nargs="+", default=[1.0, 0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.137, 0.08, 0.05, 0.02])
    ap.add_argument("--costs", help="also the cost ratio t_draft / t_target of this costs JSON "
                                    "(scripts/measure_pair.py --costs-out, as for infer.potential)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.costs:
        from infer.potential import load_costs

        measured = round(load_costs(args.costs).ratio, 4)
        args.ratios = [measured] + [c for c in args.ratios if c != measured]
    bad = [c for c in args.ratios if not 0 <= c < 1]
    if bad:
        raise SystemExit(f"--ratios: cost ratios must be in [0, 1); got {bad}")
    rows, _, _ = dataset_rows(args.data, args.split)
    if not rows:
        raise SystemExit(f"{args.data!r} split {args.split!r} has no labelled positions")
    records = grid(rows, args.gammas, args.ratios, seeds=args.seeds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(records)
    (out / "whatif.json").write_text(json.dumps(records, indent=1))
    (out / "whatif.md").write_text(f"# What-if: {args.data} ({args.split}), labels P ** gamma\n\n{text}\n")
    plot(records, out / "whatif.png")
    print(text)
    print(f"wrote {out / 'whatif.md'}, whatif.json, whatif.png")


if __name__ == "__main__":
    main()
