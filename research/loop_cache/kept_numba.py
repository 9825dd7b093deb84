"""Experiment 10 (research/loop_cache/README.md): a sampled row's sparse top-k and its draw as
numba-compiled functions, one call each where the engine's numpy way (``specdecpp.core.sampling``:
``_top_k_kept`` and ``KeptProbs.draw``) makes a dozen torch and numpy calls and a few dozen Python lines.
The same kept ids, logits and draws (checked below and by ``numba_ab.py``). Not built into the engine
(the README says why); it was, at commit 28f3cb1, as ``specdecpp/core/kernels.py``.

``install()`` puts the kernels under ``specdecpp.core.sampling`` for this process, switched by
``STATE["on"]``; ``main()`` times a random bf16 row's ``warp_kept`` and draw right after a 256 MB flush
both ways, alternating row by row (40 rows x 3 passes, top-k 50, T=1, 1 thread; the same token both
ways, checked). Needs ``pip install numba`` (not a dependency of the project).

    PYTHONPATH=. python research/loop_cache/kept_numba.py
"""

from __future__ import annotations

import functools
import statistics
import time

import numpy as np
import torch

from specdecpp.core import sampling
from specdecpp.core.sampling import SamplingConfig, warp_kept

STATE = {"on": True}


@functools.cache
def _compiled():
    import numba

    jit = numba.njit(cache=True, nogil=True)

    @jit
    def top_k_kept(x, k, chunk):
        """:func:`specdecpp.core.sampling._top_k_kept` of a float32 row ``x`` [V] (V a multiple of
        ``chunk``): the kept ids (increasing) and logits, or two empty arrays where ``x`` holds a NaN
        (the numpy way then decides)."""
        chunks = x.size // chunk
        heads = np.empty(chunks, np.float32)
        for c in range(chunks):
            m = x[c * chunk]
            for j in range(c * chunk, (c + 1) * chunk):
                v = x[j]
                if v != v:
                    return np.empty(0, np.int64), np.empty(0, np.float32)
                if v > m:
                    m = v
            heads[c] = m
        bound = np.partition(heads, chunks - k)[chunks - k]  # the k-th largest chunk maximum
        n = 0
        for c in range(chunks):
            if heads[c] >= bound:
                for j in range(c * chunk, (c + 1) * chunk):
                    n += x[j] >= bound
        ids, vals = np.empty(n, np.int64), np.empty(n, np.float32)
        n = 0
        for c in range(chunks):
            if heads[c] >= bound:
                for j in range(c * chunk, (c + 1) * chunk):
                    if x[j] >= bound:
                        ids[n], vals[n] = j, x[j]
                        n += 1
        kth = np.partition(vals, n - k)[n - k]  # the k-th largest logit
        kept = 0
        for i in range(n):
            if vals[i] >= kth:
                ids[kept], vals[kept] = ids[i], vals[i]
                kept += 1
        return ids[:kept], vals[:kept]

    @jit
    def draw(probs, u):
        """:func:`specdecpp.core.sampling.draw_few` with its uniform ``u`` given: the index drawn from
        float32 ``probs`` (float64 sums, the same clamp and search), or -1 where the row is not one
        to draw from (a negative or non-finite entry, no positive mass)."""
        total = 0.0
        for i in range(probs.size):
            p = np.float64(probs[i])
            if not p >= 0.0:  # negative or NaN
                return -1
            total += p
        if not (total > 0.0 and total < np.inf):
            return -1
        x = min(u * total, np.nextafter(total, 0.0))
        acc = 0.0
        for i in range(probs.size):
            acc += np.float64(probs[i])
            if acc > x:
                return i
        return probs.size - 1

    return top_k_kept, draw


def install() -> None:
    """The kernels under ``sampling._top_k_kept`` and ``KeptProbs.draw`` for this process, used while
    ``STATE["on"]`` (else the numpy way); float32 rows only, a row with a NaN the numpy way."""
    top_k_kept, draw = _compiled()
    numpy_kept, numpy_draw = sampling._top_k_kept, sampling.KeptProbs.draw

    def kept(x, k):
        x = x.detach() if x.requires_grad else x
        if STATE["on"] and x.dtype == torch.float32:
            ids, vals = top_k_kept(x.numpy(), k, sampling.TOP_K_CHUNK)
            if ids.size:
                return ids, vals
        return numpy_kept(x, k)

    def kept_draw(self, generator):
        if not STATE["on"]:
            return numpy_draw(self, generator)
        i = draw(self.probs, float(torch.rand(1, generator=generator, dtype=torch.float64)))
        if i < 0:
            raise ValueError(sampling.INVALID_PROBS)
        return int(self.ids[i])

    sampling._top_k_kept, sampling.KeptProbs.draw = kept, kept_draw


def main() -> None:
    torch.set_num_threads(1)
    install()
    cfg = SamplingConfig(temperature=1.0, top_k=50)
    g = torch.Generator().manual_seed(0)
    junk = np.ones(256 * 2**20 // 8)
    rows = [torch.randn(49152, generator=g).mul_(3).bfloat16() for _ in range(40)]
    t0 = time.perf_counter()
    warp_kept(rows[0], cfg).draw(g)
    print(f"first call (numba compiles, or loads from its cache): {time.perf_counter() - t0:.2f} s")
    res: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(3):
        for r in rows:
            state, tokens = g.get_state(), []
            for on in (True, False):
                STATE["on"] = on
                g.set_state(state)
                junk.sum()
                r.sum()  # the forward leaves its logits in cache
                t0 = time.perf_counter()
                tokens.append(warp_kept(r, cfg).draw(g))
                res[on].append((time.perf_counter() - t0) * 1e3)
            kept = []
            for on in (True, False):
                STATE["on"] = on
                kept.append(warp_kept(r, cfg))
            if tokens[0] != tokens[1] or not (np.array_equal(kept[0].ids, kept[1].ids)
                                              and np.array_equal(kept[0].probs, kept[1].probs)):
                raise RuntimeError("the two ways kept or drew differently")
    for on, v in res.items():
        print(f"{'numba kernels' if on else 'the numpy way (the engine)'}: cold median {statistics.median(v):.3f} ms")


if __name__ == "__main__":
    main()
