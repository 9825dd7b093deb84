"""Experiment 16: does Python's cyclic garbage collector run during the loop?

Runs ``scripts/loop_alone.py`` (its arguments pass through) with a ``gc.callbacks`` timer installed
once the pair has loaded, and prints, per generation, how many collections ran and how long they
took, over the whole run (the recorded decodes and every replay). ``GCMODE=freeze`` or ``off``
first collects, then freezes the loaded objects (``gc.freeze``) or turns the collector off, for a
comparison. Needs the demo pair (or ``--random``); about a minute for two methods and two prompts.

    SPECDECPP_CACHE=.cache PYTHONPATH=. python research/loop_cache/gc_probe.py --methods fixed_k3 target_only \
        --prompts 2 --repeats 3
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import loop_alone  # noqa: E402


class GCTimer:
    """A ``gc.callbacks`` entry: per generation, (collections, seconds, longest)."""

    def __init__(self) -> None:
        self.by_generation: dict[int, tuple[int, float, float]] = {}
        self.t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
            return
        took = time.perf_counter() - self.t0
        n, total, longest = self.by_generation.get(info["generation"], (0, 0.0, 0.0))
        self.by_generation[info["generation"]] = (n + 1, total + took, max(longest, took))


def main(argv: list[str]) -> int:
    mode = os.environ.get("GCMODE", "default")
    if mode not in ("default", "freeze", "off"):
        raise SystemExit(f"GCMODE={mode!r}: choose default, freeze or off")
    timer = GCTimer()
    real_load = loop_alone.load

    def load(*args, **kwargs):
        out = real_load(*args, **kwargs)
        print(f"tracked objects after loading: {len(gc.get_objects())}; counts {gc.get_count()}; "
              f"thresholds {gc.get_threshold()}", flush=True)
        if mode != "default":
            gc.collect()
            gc.freeze() if mode == "freeze" else gc.disable()
        gc.callbacks.append(timer)
        return out

    loop_alone.load = load
    t0 = time.perf_counter()
    loop_alone.main(argv)
    print(f"GCMODE={mode}: {time.perf_counter() - t0:.1f} s in all")
    for generation, (n, total, longest) in sorted(timer.by_generation.items()):
        print(f"generation {generation}: {n} collections, {1e3 * total:.2f} ms in all, "
              f"the longest {1e3 * longest:.2f} ms")
    if not timer.by_generation:
        print("no collection ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
