"""Reading memory on 4 KB against 2 MB pages, interleaved in one process (research/cpu_kernels, experiment 4).

Two 256 MB bf16 buffers; the second is moved onto 2 MB pages with madvise(MADV_HUGEPAGE) and
madvise(MADV_COLLAPSE) (Linux 6.1+; where transparent huge pages are "madvise", memory gets them only
when asked). Then a sum over each, alternating, ``--repeats`` times: the median GB/s of each. A
decoding forward on a CPU reads every weight once, so this is the weight-read floor on each kind of page.

    python research/cpu_kernels/huge_pages.py [--mb 256] [--repeats 30]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

HUGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25


def collapse(t: torch.Tensor) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lo = -(-t.data_ptr() // HUGE) * HUGE
    hi = (t.data_ptr() + t.nbytes) // HUGE * HUGE
    return libc.madvise(lo, hi - lo, MADV_HUGEPAGE), libc.madvise(lo, hi - lo, MADV_COLLAPSE)


def anon_huge_mb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return int(next(line for line in f if line.startswith("AnonHugePages")).split()[1]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    small = torch.ones(args.mb * 2**20 // 2, dtype=torch.bfloat16)
    huge = torch.ones_like(small)
    print("madvise (HUGEPAGE, COLLAPSE) returned", collapse(huge), f"; {anon_huge_mb()} MB on 2 MB pages")
    times: dict[str, list[float]] = {"4 KB pages": [], "2 MB pages": []}
    for _ in range(args.repeats):
        for name, t in (("4 KB pages", small), ("2 MB pages", huge)):
            t0 = time.perf_counter()
            t.sum()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(f"{name}: {small.nbytes / 1e9 / statistics.median(ts):.1f} GB/s (median of {len(ts)})")


if __name__ == "__main__":
    main()
