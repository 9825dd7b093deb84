"""Experiment 10 (research/loop_cache/README.md): a sampled row's sparse top-k, softmax and draw as
one numba-compiled function, against the engine's way (``warp_kept`` then ``KeptProbs.draw``: a dozen
torch and numpy operations and a few dozen Python lines), right after a forward-sized cache flush.
Random bf16 rows of 49,152 logits, top-k 50, T=1, 1 thread, 40 rows x 3 passes, each timed after a
numpy read of 256 MB; the same uniform for both, so the same token.

    PYTHONPATH=. python research/loop_cache/kept_numba.py
"""

from __future__ import annotations

import statistics
import time

import numba
import numpy as np
import torch

from specdecpp.core.sampling import SamplingConfig, warp_kept


@numba.njit(cache=True, nogil=True)
def kept_draw(bits, k, inv_t, u, ids_out, probs_out):
    """bits: the row's bf16 values as uint16 [V], V a multiple of 64. Returns (n kept, token)."""
    x = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    chunks = x.size // 64
    heads = np.empty(chunks, np.float32)
    for c in range(chunks):
        m = x[c * 64]
        for j in range(1, 64):
            v = x[c * 64 + j]
            if v > m:
                m = v
        heads[c] = m
    bound = np.partition(heads, chunks - k)[chunks - k]
    n = 0
    vals = np.empty(chunks * 64 if k * 64 > chunks * 64 else k * 64, np.float32)
    cand = np.empty(vals.size, np.int64)
    for c in range(chunks):
        if heads[c] >= bound:
            for j in range(64):
                v = x[c * 64 + j]
                if v >= bound and n < vals.size:
                    vals[n] = v
                    cand[n] = c * 64 + j
                    n += 1
    kth = np.partition(vals[:n], n - k)[n - k]
    m = -np.inf
    kept = 0
    for i in range(n):
        if vals[i] >= kth:
            ids_out[kept] = cand[i]
            probs_out[kept] = vals[i] * inv_t
            if probs_out[kept] > m:
                m = probs_out[kept]
            kept += 1
    total32 = np.float32(0.0)
    for i in range(kept):
        e = np.float32(np.exp(probs_out[i] - m))
        probs_out[i] = e
        total32 += e
    for i in range(kept):
        probs_out[i] = probs_out[i] / total32
    cum = 0.0
    for i in range(kept):
        cum += np.float64(probs_out[i])
    target = min(u * cum, np.nextafter(cum, 0.0))
    acc = 0.0
    for i in range(kept):
        acc += np.float64(probs_out[i])
        if acc > target:
            return kept, ids_out[i]
    return kept, ids_out[kept - 1]


def main() -> None:
    torch.set_num_threads(1)
    cfg = SamplingConfig(temperature=1.0, top_k=50)
    g = torch.Generator().manual_seed(0)
    junk = np.ones(256 * 2**20 // 8)
    rows = [torch.randn(49152, generator=g).mul_(3).bfloat16() for _ in range(40)]
    ids_out, probs_out = np.empty(4096, np.int64), np.empty(4096, np.float32)
    t0 = time.perf_counter()
    kept_draw(rows[0].view(torch.int16).numpy().view(np.uint16), 50, 1.0, 0.5, ids_out, probs_out)
    print(f"numba's first call (compile or load from its cache): {time.perf_counter() - t0:.2f} s")
    res = {"warp_kept + draw (the engine's way)": [], "one numba function": []}
    same = 0
    for _ in range(3):
        for r in rows:
            for name in res:
                junk.sum()
                r.sum()  # the forward leaves its logits in cache
                state = g.get_state()
                t0 = time.perf_counter()
                if name.startswith("warp_kept"):
                    a = warp_kept(r, cfg).draw(g)
                else:
                    u = float(torch.rand(1, generator=g, dtype=torch.float64))
                    n, b = kept_draw(r.view(torch.int16).numpy().view(np.uint16), cfg.top_k, 1.0, u, ids_out, probs_out)
                res[name].append((time.perf_counter() - t0) * 1e3)
                if name.startswith("warp_kept"):
                    g.set_state(state)
            same += int(a == b)
    for name, v in res.items():
        print(f"{name}: cold median {statistics.median(v):.3f} ms")
    print(f"same token {same}/{3 * len(rows)}")


if __name__ == "__main__":
    main()
