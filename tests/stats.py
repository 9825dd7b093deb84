"""A chi-square goodness-of-fit helper shared by the distribution tests."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy import stats


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
