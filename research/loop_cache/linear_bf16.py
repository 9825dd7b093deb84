"""The side finding's micro-benchmark (README.md, "bf16 without AMX"): one-row F.linear of the demo
target's shapes in float32 and bf16, one thread, torch.utils.benchmark medians, and the effective
bandwidth (weight bytes / time).

    python research/loop_cache/linear_bf16.py
"""

import torch
import torch.nn.functional as F
from torch.utils import benchmark

torch.set_num_threads(1)
caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
print("avx512_bf16:", bool(caps.get("avx512_bf16")), "amx_bf16:", bool(caps.get("amx_bf16")))
for fan_in, fan_out in ((576, 1536), (1536, 576), (576, 49152)):
    for dtype in (torch.float32, torch.bfloat16):
        w, x = torch.randn(fan_out, fan_in).to(dtype), torch.randn(1, fan_in).to(dtype)
        t = benchmark.Timer("F.linear(x, w)", globals={"F": F, "x": x, "w": w}).blocked_autorange(min_run_time=1).median
        mb = w.numel() * w.element_size() / 1e6
        print(f"{fan_in} x {fan_out} {str(dtype).removeprefix('torch.')}: {1e6 * t:.0f} us, {mb / t / 1e3:.1f} GB/s")
