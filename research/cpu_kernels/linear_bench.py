"""Experiment 2 of README.md: a one-row (and few-row) bf16 linear layer on one thread, the demo
target's shapes: F.linear, oneDNN's prepacked linear, and the AVX512-BF16 kernel beside this file
(linear_bf16.cpp, built here with torch.utils.cpp_extension: needs g++ and a CPU with avx512_bf16),
in cache and streamed from memory (60 weights of 1536 x 576, 106 MB, in turn).

    python research/cpu_kernels/linear_bench.py
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark
from torch.utils.cpp_extension import load_inline

torch.set_num_threads(1)
ext = load_inline("specdecpp_linear_bf16", cpp_sources=[(Path(__file__).parent / "linear_bf16.cpp").read_text()],
                  functions=["linear_bf16"], extra_cflags=["-O3", "-mavx512f", "-mavx512bf16", "-mavx512bw", "-mavx512vl"])


def timed(stmt: str, **names) -> float:
    return benchmark.Timer(stmt, globals={"F": F, "torch": torch, "ext": ext, **names}).blocked_autorange(
        min_run_time=1).median


for rows, fan_in, fan_out in ((1, 576, 1536), (1, 1536, 576), (1, 576, 49152), (4, 576, 1536)):
    w, x = torch.randn(fan_out, fan_in).bfloat16(), torch.randn(rows, fan_in).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    gb = w.numel() * 2 / 1e9
    out = {"F.linear": timed("F.linear(x, w)", x=x, w=w),
           "oneDNN prepacked": timed("torch.ops.mkldnn._linear_pointwise(x, p, None, 'none', [], '')", x=x, p=packed),
           "linear_bf16.cpp": timed("ext.linear_bf16(x, w, None)", x=x, w=w)}
    print(f"{rows} x {fan_in} -> {fan_out}: " + ", ".join(f"{k} {1e6 * t:.0f} us ({gb / t:.1f} GB/s)" for k, t in out.items()))
ws, x = [torch.randn(1536, 576).bfloat16() for _ in range(60)], torch.randn(1, 576).bfloat16()
gb = sum(w.numel() for w in ws) * 2 / 1e9
for name, stmt in (("F.linear", "[F.linear(x, w) for w in ws]"), ("linear_bf16.cpp", "[ext.linear_bf16(x, w, None) for w in ws]")):
    t = timed(stmt, x=x, ws=ws)
    print(f"60 x (1536 x 576) streamed, {name}: {1e3 * t:.2f} ms ({gb / t:.1f} GB/s)")
