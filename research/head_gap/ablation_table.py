"""Collect the dev (and validation) metrics of trained heads into a markdown table.

    python research/head_gap/ablation_table.py heads/ablation/*/*     # one row per head directory
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(dirs: list[str]) -> None:
    print("| head | features | context | dev AUROC | dev KL (constant) | dev ECE | train AUROC | best epoch |")
    print("|---|---|---|---|---|---|---|---|")
    for d in dirs:
        cfg_file = Path(d) / "config.json"
        if not cfg_file.is_file():
            continue
        cfg = json.loads(cfg_file.read_text())
        m, training = cfg.get("metrics", {}), cfg.get("training", {})
        dev, train = m.get("dev", {}), m.get("train", {})
        features = "+".join(cfg.get("features", ["hidden"])) + (f" (m={cfg['top_m']})" if "top_m" in cfg else "")
        print(f"| {d} | {features} | {training.get('feature_context', 'mixed')} | "
              f"{dev.get('AUROC', float('nan')):.3f} | "
              f"{dev.get('KL', float('nan')):.4f} ({dev.get('KL_const', float('nan')):.4f}) | "
              f"{dev.get('ECE', float('nan')):.3f} | {train.get('AUROC', float('nan')):.3f} | "
              f"{training.get('best_epoch')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
