"""Experiment 6 (research/loop_cache/README.md): what a draft candidate's sparse top-k and draw cost
right after a forward-sized cache flush, as the engine does them (``warp_kept`` then ``KeptProbs.draw``)
and from a top-64 that a compiled step would have handed back with its logits (only the softmax
over the kept values and the draw left outside). Random bf16 rows of 49,152 logits, top-k 50, T=1,
1 thread, 40 rows x 3 passes, each timed after a numpy read of 256 MB.

    PYTHONPATH=. python research/loop_cache/kept_cold.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from specdecpp.core.sampling import SamplingConfig, draw_few, warp_kept


def main() -> None:
    torch.set_num_threads(1)
    cfg = SamplingConfig(temperature=1.0, top_k=50)
    g = torch.Generator().manual_seed(0)
    junk = np.ones(256 * 2**20 // 8)
    rows = [torch.randn(49152, generator=g).mul_(3).bfloat16() for _ in range(40)]
    tops = [torch.topk(r.float(), 64) for r in rows]  # what a compiled step would return beside its logits
    res = {"warp_kept + draw (the engine's way)": [], "from a top-64 handed back by the step": []}
    for _ in range(3):
        for i, r in enumerate(rows):
            for name in res:
                junk.sum()
                r.sum()  # the forward leaves its logits in cache
                t0 = time.perf_counter()
                if name.startswith("warp_kept"):
                    warp_kept(r, cfg).draw(g)
                else:
                    vals, ids = tops[i]
                    v = vals.numpy()
                    n = int((v >= v[cfg.top_k - 1]).sum())  # ties at the k-th kept (64 would mean: fall back)
                    p = torch.from_numpy(v[:n].copy()).softmax(-1).numpy()
                    order = np.argsort(ids.numpy()[:n])  # inverse CDF in vocabulary order, as the dense draw
                    int(ids[order[draw_few(p[order].tolist(), g)]])
                res[name].append((time.perf_counter() - t0) * 1e3)
    for name, v in res.items():
        print(f"{name}: cold median {statistics.median(v):.3f} ms")


if __name__ == "__main__":
    main()
