"""The learning curve of research/head_gap/probe_features.py runs, as a table and a PNG.

    python research/head_gap/plot_learning_curve.py reports/probe_data_curve/probe.json \
        reports/probe_data_curve920/probe.json --out reports/data_curve/learning_curve.png

Every result row of the given probe.json files is placed by its feature set (the set's name
without the ``[train ..%, width ..]`` suffix) and its number of train responses; a point that
several files hold (the same set and size) keeps the last file's. For each scored split (dev and
every ``--eval`` set) it plots AUROC and the share of the perfect lag-free head's margin over the
best fixed K against the train responses (log scale), one line per feature set, and prints the
same figures as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def curve_points(paths: list[str]) -> dict[str, dict[int, dict]]:
    """{feature set: {train responses: the probe's result row}}, later files winning ties."""
    points: dict[str, dict[int, dict]] = {}
    for path in paths:
        try:
            results = json.loads(Path(path).read_text())["results"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"plot_learning_curve: {path} is not a probe_features.py probe.json ({e})") from None
        for r in results:
            name = re.sub(r"\s*\[train [^\]]*\]$", "", r["set"])
            points.setdefault(name, {})[int(r["train_prompts"])] = r
    return points


def scored_splits(points: dict[str, dict[int, dict]]) -> list[str]:
    """The splits the probe scored (dev and its --eval sets), from the first result row."""
    return list(next(iter(next(iter(points.values())).values()))["splits"])


def short(split: str) -> str:
    return split if split == "dev" else Path(split.split(":")[0]).name


def table(points: dict[str, dict[int, dict]]) -> str:
    splits = scored_splits(points)
    head = "| feature set | train responses (positions) | " + " | ".join(
        f"{short(s)} AUROC | {short(s)} margin (share)" for s in splits) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(splits))]
    for name, by_n in points.items():
        for n in sorted(by_n):
            r = by_n[n]
            cells = []
            for s in splits:
                m = r["splits"][s]
                cells += [f"{m['AUROC']:.3f}", f"{100 * m['probe']['margin']:+.1f}% ({m['share_of_perfect']:.2f})"]
            lines.append(f"| {name} | {n} ({r['train_positions']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(points: dict[str, dict[int, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = scored_splits(points)
    fig, axes = plt.subplots(2, len(splits), figsize=(4.2 * len(splits), 6.4), squeeze=False)
    for j, s in enumerate(splits):
        for name, by_n in points.items():
            ns = sorted(by_n)
            axes[0][j].plot(ns, [by_n[n]["splits"][s]["AUROC"] for n in ns], marker="o", label=name)
            axes[1][j].plot(ns, [by_n[n]["splits"][s]["share_of_perfect"] for n in ns], marker="o", label=name)
        axes[0][j].set_title(short(s))
        axes[1][j].axhline(0.5, color="grey", ls="--", lw=1)  # the goal: half of the perfect head's margin
        for i, what in enumerate(("AUROC", "share of the perfect head's margin")):
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_xlabel("train responses")
            axes[i][j].set_ylabel(what)
            axes[i][j].grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Stop-predictor probe: learning curve")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe_json", nargs="+", help="probe.json files of research/head_gap/probe_features.py")
    ap.add_argument("--out", default="reports/data_curve/learning_curve.png")
    args = ap.parse_args(argv)
    points = curve_points(args.probe_json)
    if not points:
        raise SystemExit("plot_learning_curve: the probe.json files hold no results")
    print(table(points))
    plot(points, Path(args.out))
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
