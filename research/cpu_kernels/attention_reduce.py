"""Experiment 5 of README.md: the static runners' CPU attention compiled with the CPU's settings
(freezing + max_autotune, inductor's C++ GEMM template), as two matrix products (what the engine's
`cpu_attention` does) against products and sums that inductor fuses into
reductions reading the bf16 cache directly. The demo target's shapes (9 query heads, 3 key-value
heads of 64), a static cache of L slots, q query tokens, one thread; each form is its own compiled
function, timed interleaved with torch.utils.benchmark.

    python research/cpu_kernels/attention_reduce.py
"""

import torch
from torch._inductor import config as inductor_config
from torch.utils import benchmark

torch.set_num_threads(1)
OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def matmuls(query, key, value, mask):
    batch, heads, q, dim = query.shape
    kv, group = key.shape[1], heads // key.shape[1]
    scores = torch.matmul(query.reshape(batch, kv, group * q, dim).float(), key.float().transpose(-1, -2))
    scores = scores.mul_(dim ** -0.5).view(batch, kv, group, q, -1) + mask[:, :, None].float()
    probs = scores.softmax(-1).view(batch, kv, group * q, -1)
    return torch.matmul(probs, value.float()).view(batch, heads, q, dim).to(query.dtype)


def reductions(query, key, value, mask):
    batch, heads, q, dim = query.shape
    kv, group = key.shape[1], heads // key.shape[1]
    scores = (query.reshape(batch, kv, group * q, 1, dim).float() * key[:, :, None].float()).sum(-1)
    scores = (scores * dim ** -0.5).view(batch, kv, group, q, -1) + mask[:, :, None].float()
    probs = scores.softmax(-1).view(batch, kv, group * q, -1, 1)
    out = (probs * value[:, :, None].float()).sum(-2)
    return out.view(batch, heads, q, dim).to(query.dtype)


def swapped(query, key, value, mask):
    batch, heads, q, dim = query.shape
    kv, group = key.shape[1], heads // key.shape[1]
    scores = torch.matmul(key.float(), query.reshape(batch, kv, group * q, dim).float().transpose(-1, -2))
    scores = (scores.transpose(-1, -2) * dim ** -0.5).view(batch, kv, group, q, -1) + mask[:, :, None].float()
    probs = scores.softmax(-1).view(batch, kv, group * q, -1)
    return torch.matmul(probs, value.float()).view(batch, heads, q, dim).to(query.dtype)


def compiled(fn):
    step = torch.compile(fn, fullgraph=True, dynamic=False, options=OPTIONS)

    def call(*args):
        with torch.no_grad(), inductor_config.patch(freezing=True):
            return step(*args)
    return call


def main():
    forms = {"matmuls": compiled(matmuls), "reductions": compiled(reductions), "swapped": compiled(swapped)}
    print(f"torch {torch.__version__}, 1 thread, bf16 cache, compiled with {OPTIONS}")
    print("| cache slots L, query tokens q | matmuls us | reductions us | swapped us | max abs diff |")
    print("|---|---|---|---|---|")
    for length, q in ((256, 1), (512, 1), (1024, 1), (256, 4), (512, 4), (256, 8), (512, 32)):
        gen = torch.Generator().manual_seed(length + q)
        query = torch.randn(1, 9, q, 64, generator=gen).bfloat16()
        key, value = (torch.randn(1, 3, length, 64, generator=gen).bfloat16() for _ in range(2))
        mask = torch.zeros(1, 1, q, length)
        mask[..., length // 3:] = torch.finfo(torch.float32).min
        outs = {name: fn(query, key, value, mask) for name, fn in forms.items()}
        diff = max((outs["matmuls"].float() - o.float()).abs().max().item() for o in outs.values())
        times = {name: [] for name in forms}
        for _ in range(5):  # interleaved blocks
            for name, fn in forms.items():
                t = benchmark.Timer("fn(a, b, c, d)", globals={"fn": fn, "a": query, "b": key, "c": value, "d": mask})
                times[name].append(t.blocked_autorange(min_run_time=0.2).median * 1e6)
        med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
        print(f"| {length}, {q} | {med['matmuls']:.1f} | {med['reductions']:.1f} | "
              f"{med['swapped']:.1f} | {diff:.3g} |")


if __name__ == "__main__":
    main()
