"""The distribution tests' shared helpers: a chi-square goodness-of-fit test, the exact
distribution of generated sequences by enumeration, and the grids of cases those tests run
(``make test`` a few of them, ``make test-full`` all)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from specdecpp import warp


def chi_square_pvalue(samples: list, expected: dict, min_expected: float = 5.0) -> float:
    """p-value that ``samples`` were drawn from the distribution ``expected`` (outcome -> prob).

    Outcomes whose expected count is below ``min_expected`` are pooled into one cell, so the
    chi-square approximation holds. A sample outside the support of ``expected`` gives 0.
    """
    n = len(samples)
    counts = Counter(samples)
    if any(k not in expected or expected[k] <= 0 for k in counts):
        return 0.0
    obs, exp, pool_obs, pool_exp = [], [], 0, 0.0
    for k, p in expected.items():
        if p * n >= min_expected:
            obs.append(counts.get(k, 0))
            exp.append(p * n)
        else:
            pool_obs += counts.get(k, 0)
            pool_exp += p * n
    if pool_exp > 0:
        obs.append(pool_obs)
        exp.append(pool_exp)
    exp_arr = np.array(exp)
    exp_arr *= n / exp_arr.sum()  # normalise away float rounding
    return float(stats.chisquare(np.array(obs), exp_arr).pvalue)


def sequence_distribution(next_probs, prompt, n_tokens, eos=None):
    """P(generated sequence) by enumeration when every position samples from ``next_probs(ids)``
    (a probability vector after the token ids ``ids``): n_tokens, or fewer ending at EOS."""
    dist = {}

    def walk(ids, prob, out):
        if len(out) == n_tokens or (out and out[-1] == eos):
            dist[tuple(out)] = prob
            return
        with torch.no_grad():
            probs = next_probs(ids)
        for tok in range(probs.shape[-1]):
            if float(probs[tok]) > 0:
                walk(ids + [tok], prob * float(probs[tok]), out + [tok])

    walk(list(prompt), 1.0, [])
    return dist


def exact_distribution(target, prompt, n_tokens, sampling, eos=None):
    """P(generated sequence) with the target alone: n_tokens, or fewer ending at EOS."""
    return sequence_distribution(lambda ids: warp(target(torch.tensor([ids])).logits[0, -1], sampling),
                                 prompt, n_tokens, eos)


def sampled_grid(*axes, fast: set[str]) -> list:
    """One parametrization over the product of ``axes`` (lists of ``pytest.param``, each with an
    id; a device axis has the ids ``cpu`` and ``cuda``). A chi-square test samples 1,200 decodes,
    10-30 s on the CPU: ``make test`` runs the cases named in ``fast`` (ids without the device),
    every other CPU case is marked slow for ``make test-full``. CUDA cases keep their own marks."""
    params, names = [], set()
    for combo in itertools.product(*axes):
        ids = [p.id for p in combo]
        case = "-".join(i for i in ids if i not in ("cpu", "cuda"))
        names.add(case)
        marks = [m for p in combo for m in p.marks]
        if "cuda" not in ids and case not in fast:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(*(v for p in combo for v in p.values), id="-".join(ids), marks=marks))
    if fast - names:
        raise ValueError(f"fast cases {sorted(fast - names)} are not in the grid (its cases: {sorted(names)})")
    return params
