"""Print the reference heads of demo/heads/selection.json in the forms the Makefile passes on.

    python -m specdecpp_demo.ref_heads dirs [resnet|next|all]
        demo/heads/wrej3_d3,demo/heads/wrej1_d0
    python -m specdecpp_demo.ref_heads points
        {head:demo/heads/wrej3_d3,threshold:0.5},...  (every selected head at its best dev threshold)
    python -m specdecpp_demo.ref_heads grids
        {head:[A,B],threshold:[0.1,0.2,0.5]},{head:[C,D],...}  (each kind's two heads at that kind's
        three thresholds)

Prints nothing (exit 0) when selection.json is missing, so a Makefile that reads it still parses.
The standard library only: the Makefile runs it as a file (``python specdecpp_demo/ref_heads.py``),
which skips the package's torch import on every ``make``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SELECTION = Path(__file__).resolve().parents[1] / "demo" / "heads" / "selection.json"
KEYS = {"resnet": ["heads"], "next": ["lag_free_heads"], "all": ["heads", "lag_free_heads"]}


def main(argv: list[str]) -> str:
    if not SELECTION.is_file():
        return ""
    selection = json.loads(SELECTION.read_text())
    what = argv[0] if argv else "dirs"
    if what == "dirs":
        keys = KEYS[argv[1] if len(argv) > 1 else "all"]
        return ",".join(f"demo/heads/{h['name']}" for key in keys for h in selection.get(key, []))
    if what == "points":
        best = {r["name"]: r["best_threshold"] for r in selection["ranking"]}
        return ",".join(f"{{head:demo/heads/{h['name']},threshold:{best[h['name']]}}}"
                        for key in KEYS["all"] for h in selection.get(key, []))
    if what == "grids":
        grids = []
        for key in KEYS["all"]:
            heads = selection.get(key, [])
            if heads:
                names = ",".join(f"demo/heads/{h['name']}" for h in heads)
                thresholds = ",".join(str(t) for t in heads[0]["thresholds"])
                grids.append(f"{{head:[{names}],threshold:[{thresholds}]}}")
        return ",".join(grids)
    raise SystemExit(f"unknown request {what!r}: dirs [resnet|next|all], points or grids")


if __name__ == "__main__":
    print(main(sys.argv[1:]))
