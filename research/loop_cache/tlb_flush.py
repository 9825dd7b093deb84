"""Experiment 7 (research/loop_cache/README.md): is the cold loop's cost the TLB or the caches?

A forward of the demo target streams 269 MB of weights, most of them on 4 KB pages: it evicts the
caches and also fills the TLB with some 65,000 pages. A flush of the same size on 2 MB pages
(128 pages) evicts the caches as much but hardly touches the TLB. If the TLB were what makes the
loop's small operations slow after a forward, they would be slower after the 4 KB flush than after
the 2 MB one. Single small operations of the loop, each timed right after a 256 MB read, the two
flushes alternating; medians in microseconds. Needs transparent huge pages in `madvise` or
`always` mode (it prints AnonHugePages: about 256 MB more when the 2 MB flush got its pages).

    PYTHONPATH=. python research/loop_cache/tlb_flush.py [--repeats 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _set_madvise_hugepage


def flush_buffer(huge: bool, mb: int) -> np.ndarray:
    """``mb`` MB of float32 ones, on 2 MB pages (numpy's madvise) or on 4 KB ones."""
    _set_madvise_hugepage(huge)
    try:
        return np.ones(mb * 2**18, np.float32)
    finally:
        _set_madvise_hugepage(True)


def anon_huge_kb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--flush-mb", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    x, gen = torch.randn(50), torch.Generator().manual_seed(0)
    ops = {"x + 1 (50 floats)": lambda: x + 1,
           "torch.rand(1), float64": lambda: torch.rand(1, generator=gen, dtype=torch.float64),
           "np.partition (50 floats)": lambda: np.partition(x.numpy(), 40),
           "sum(range(100))": lambda: sum(range(100))}
    before = anon_huge_kb()
    flushes = {"4 KB pages": flush_buffer(False, args.flush_mb), "2 MB pages": flush_buffer(True, args.flush_mb)}
    print(f"AnonHugePages grew by {(anon_huge_kb() - before) / 1024:.0f} MB")
    times: dict = {kind: {name: [] for name in ops} for kind in flushes}
    for _ in range(args.repeats):
        for kind, buf in flushes.items():
            for name, op in ops.items():
                buf.sum()
                t0 = time.perf_counter()
                op()
                times[kind][name].append(time.perf_counter() - t0)
    print("| operation, right after the flush | " + " | ".join(f"flush on {k}, us" for k in flushes) + " |")
    print("|---|" + "---|" * len(flushes))
    for name in ops:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[k][name]) * 1e6:.1f}" for k in flushes) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
