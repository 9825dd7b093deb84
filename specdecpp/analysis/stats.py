"""Bootstrap intervals over prompts, through ``scipy.stats.bootstrap`` (the project's one bootstrap).

Every figure the project reports is a pooled ratio over prompts (total tokens / total time, Eq. 2.3
from pooled counts), and two methods compared on the same prompts are compared *paired*: each
resample draws prompts with replacement and takes the same prompts for every sample. Samples are
one value per prompt (1-D arrays of equal length when paired); statistics are vectorized, i.e.
take the resampled arrays and an ``axis`` to reduce along.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import stats as _scipy_stats

METHODS = ("percentile", "basic", "BCa")


def bootstrap_interval(statistic: Callable[..., np.ndarray], *samples, paired: bool = True,
                       n_resamples: int = 1000, level: float = 0.95, method: str = "percentile",
                       seed: int = 0) -> tuple[float, float]:
    """``level`` interval of ``statistic(*samples, axis=-1)`` over resampled prompts.

    ``paired=True`` resamples the same prompts for every sample (the samples must have equal
    lengths); ``paired=False`` resamples each sample on its own. ``method``: ``percentile`` (the
    default; what the project's figures use), ``basic`` or ``BCa``. Fewer than two prompts has no
    interval: (nan, nan).
    """
    if method not in METHODS:
        raise ValueError(f"bootstrap method must be one of {METHODS}, got {method!r}")
    if not 0 < level < 1:
        raise ValueError(f"bootstrap level must be in (0, 1), got {level!r}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples!r}")
    arrays = [np.asarray(s, dtype=np.float64) for s in samples]
    if not arrays or any(a.ndim != 1 for a in arrays):
        raise ValueError(f"bootstrap samples must be 1-D arrays (one value per prompt), got shapes "
                         f"{[a.shape for a in arrays]}")
    if paired and len({len(a) for a in arrays}) > 1:
        raise ValueError(f"paired bootstrap samples must have equal lengths, got {[len(a) for a in arrays]}")
    if min(len(a) for a in arrays) < 2:
        return (math.nan, math.nan)
    res = _scipy_stats.bootstrap(tuple(arrays), statistic, n_resamples=n_resamples, vectorized=True,
                                 paired=paired, axis=-1, confidence_level=level, method=method,
                                 rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def pooled_ratio(num: np.ndarray, den: np.ndarray, axis: int = -1) -> np.ndarray:
    """sum(num) / sum(den) along ``axis``: e.g. tokens / seconds pooled over prompts."""
    return np.sum(num, axis=axis) / np.sum(den, axis=axis)


def paired_ratio_interval(num_a, den_a, num_b, den_b, **kwargs) -> tuple[float, float]:
    """Interval of (sum num_a / sum den_a) / (sum num_b / sum den_b) over the same resampled
    prompts, e.g. the speedup of method a over method b in tokens/s."""
    def ratio(na, da, nb, db, axis=-1):
        return pooled_ratio(na, da, axis) / pooled_ratio(nb, db, axis)

    return bootstrap_interval(ratio, num_a, den_a, num_b, den_b, paired=True, **kwargs)
