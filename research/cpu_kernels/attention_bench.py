"""Experiment 1 of README.md: one query (or four) over a static cache of L positions, the demo target's
attention shapes (9 heads of 64), bf16, one thread: PyTorch's scaled_dot_product_attention (its
fused CPU kernel), its math backend, and two matrix products and a softmax (eager, compiled).

    python research/cpu_kernels/attention_bench.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import benchmark

torch.set_num_threads(1)


def timed(fn) -> float:
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5).median


def row(q, k, v, mask) -> dict:
    """The four ways, each a callable of no arguments over these inputs."""
    def math():
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def manual():
        s = (q.float() @ k.float().transpose(-1, -2)) * 0.125 + mask.float()
        return (s.softmax(-1) @ v.float()).bfloat16()

    compiled = torch.compile(manual, fullgraph=True, dynamic=False)
    compiled()
    return {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), "sdpa math": math,
            "matmul + softmax": manual, "compiled": compiled}


for length, n in ((264, 1), (520, 1), (520, 4), (2056, 1)):
    q = torch.randn(1, 9, n, 64).bfloat16()
    k, v = (torch.randn(1, 9, length, 64).bfloat16() for _ in range(2))
    mask = torch.zeros(1, 1, n, length).bfloat16()
    mask[..., length // 2:] = torch.finfo(torch.bfloat16).min
    ways = row(q, k, v, mask)
    print(f"L={length} q={n}: " + ", ".join(f"{name} {1e6 * timed(fn):.0f} us" for name, fn in ways.items()), flush=True)
