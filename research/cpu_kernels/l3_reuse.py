"""Experiment 6 (README.md): does a forward-sized read hit the L3 when it is repeated?

The Intel Xeon machines this project runs on report a 300 MB L3 for the socket. The demo target's
weights are 269 MB in bf16. If the L3 keeps part of them between two forwards, a forward can read
faster than the floor. The floor is a 256 MB copy (``scripts/bench_fast.py``), and a copy moves
512 MB, more than the L3 holds. Then the floor criterion would depend on how much of the L3 the
other tenants use that day.

This script times three reads in turn, on one thread, with the medians of ``--repeats`` calls each:

- ``sum`` over a float32 buffer of the weights' size (269 MB), the same buffer every time, as a
  decode reads the same weights every forward;
- the same ``sum`` over a buffer of ``--big-mb`` MB (default 2048 MB, far more than any L3),
  in GB/s;
- the floor's 256 MB copy, in GB/s of read and written bytes, as ``bench_fast`` reports it;
- a bf16 matrix product of 1024 x 1024 by 1024 x 1024, which runs on arithmetic, not memory (each
  element of its 2 MB operands is used 1,024 times), in TFLOP/s: a day's compute against another's,
  where the reads above give its memory.

If the 269 MB read runs faster per byte than the big one, the cache holds part of it between
reads. The buffers are float32 because a bf16 ``sum`` converts every element and runs at about
7.5 GB/s on one thread here: it measures its arithmetic, not the memory. The big buffer is read by
the same kernel, so the two are compared like for like.

    PYTHONPATH=. python research/cpu_kernels/l3_reuse.py [--repeats 15] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch
from torch.utils import benchmark


def median_s(stmt: str, env: dict, repeats: int) -> float:
    timer = benchmark.Timer(stmt=stmt, globals=env, num_threads=1)
    return timer.timeit(repeats).median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights-mb", type=float, default=269.03, help="the demo target's bf16 weights")
    ap.add_argument("--big-mb", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the three reads, interleaved")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mb = 1e6
    small = torch.ones(int(args.weights_mb * mb / 4), dtype=torch.float32)
    big = torch.ones(int(args.big_mb * mb / 4), dtype=torch.float32)
    src = torch.ones(256 * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    a = torch.randn(1024, 1024, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, dtype=torch.bfloat16)
    env = {"small": small, "big": big, "src": src, "dst": dst, "a": a, "b": b}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread")
    print("| pass | sum over 269 MB, again and again: ms, GB/s | sum over the big buffer: GB/s | "
          "256 MB copy: GB/s (read + written) | 269 MB at the copy's rate: ms | bf16 matmul: TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in range(args.rounds):
        t_small = median_s("small.sum()", env, args.repeats)
        t_big = median_s("big.sum()", env, max(3, args.repeats // 4))
        t_copy = median_s("dst.copy_(src)", env, args.repeats)
        t_mm = median_s("a @ b", env, args.repeats)
        copy_gb_s = 2 * src.numel() * 4 / t_copy / 1e9
        print(f"| {r + 1} | {1e3 * t_small:.2f}, {small.numel() * 4 / t_small / 1e9:.1f} | "
              f"{big.numel() * 4 / t_big / 1e9:.1f} | {copy_gb_s:.1f} | "
              f"{1e3 * small.numel() * 4 / (copy_gb_s * 1e9):.2f} | {2 * 1024 ** 3 / t_mm / 1e12:.2f} |")


if __name__ == "__main__":
    main()
