"""The CPU's sparse sampling (:func:`specdecpp.core.sampling.warp_kept`, :meth:`KeptProbs.draw`) as
numba-compiled functions: each is one call where the numpy way makes a dozen torch and numpy
calls and a few dozen Python lines.

Why: on a CPU every forward streams the model's weights through the caches, so the loop between two
forwards starts cold, and each distinct operation it makes pays to bring its code back (tens of
microseconds each; docs/engine.md, "The loop on a CPU: cold caches"). One compiled function in place
of a dozen operations pays that once. The results are the numpy way's, value for value (tested):
the same kept ids and logits, the same draw for the same uniform.

numba compiles each function on its first call (some seconds) and keeps the machine code in its
cache (``cache=True``: a ``__pycache__`` beside this file, or numba's user cache directory where
that is not writable), so a later process loads it in well under a second. Where numba cannot be
imported, or ``SPECDECPP_NUMBA=0`` is set, :func:`get` returns None and the callers take the numpy
way.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

log = logging.getLogger(__name__)

DISABLE_ENV = "SPECDECPP_NUMBA"  # "0": the numpy way (e.g. to compare the two in one benchmark)


@functools.cache
def _compiled():
    try:
        import numba
    except Exception as exc:  # noqa: BLE001 - not installed, or built against another numpy
        log.info("numba is not available (%s): the CPU's sparse sampling takes the numpy way", exc)
        return None
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


def get():
    """``(top_k_kept, draw)`` compiled, or None (numba missing, or ``SPECDECPP_NUMBA=0``)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    return _compiled()
