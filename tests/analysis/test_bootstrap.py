"""specdecpp.analysis.stats: the project's one bootstrap (scipy's), paired and unpaired."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specdecpp.analysis.stats import bootstrap_interval, paired_ratio_interval, pooled_ratio


def mean(x, axis=-1):
    return np.mean(x, axis=axis)


def test_interval_covers_the_mean_of_a_known_sample_with_the_normal_width():
    x = np.random.default_rng(0).normal(5.0, 1.0, 400)
    lo, hi = bootstrap_interval(mean, x, n_resamples=2000)
    assert lo < x.mean() < hi and lo < 5.0 < hi
    # the percentile interval of a mean is close to mean +- 1.96 s / sqrt(n)
    assert hi - lo == pytest.approx(2 * 1.96 * x.std(ddof=1) / math.sqrt(len(x)), rel=0.1)
    assert bootstrap_interval(mean, x, n_resamples=2000, level=0.5)[1] - bootstrap_interval(
        mean, x, n_resamples=2000, level=0.5)[0] < (hi - lo) / 2  # a lower level is narrower
    assert bootstrap_interval(mean, x, seed=3) == bootstrap_interval(mean, x, seed=3)  # reproducible
    lo_bca, hi_bca = bootstrap_interval(mean, x, method="BCa")
    assert lo_bca < 5.0 < hi_bca


def test_paired_resampling_keeps_prompts_together_and_unpaired_does_not():
    """Two methods on the same prompts: per-prompt difficulty varies a lot, the difference between
    the methods very little. Paired, the interval of the mean difference is as narrow as the
    difference's own noise; unpaired, it carries the prompts' spread too."""
    rng = np.random.default_rng(1)
    difficulty = rng.normal(0.0, 10.0, 100)
    a, b = difficulty + 1.0 + rng.normal(0.0, 0.1, 100), difficulty

    def diff(x, y, axis=-1):
        return np.mean(x, axis=axis) - np.mean(y, axis=axis)

    paired = bootstrap_interval(diff, a, b, paired=True)
    unpaired = bootstrap_interval(diff, a, b, paired=False)
    assert paired[0] < 1.0 < paired[1] and unpaired[0] < 1.0 < unpaired[1]
    assert paired[1] - paired[0] < 0.1 < 1.0 < unpaired[1] - unpaired[0]
    # unpaired samples may differ in length; paired ones may not
    assert not math.isnan(bootstrap_interval(diff, a, b[:50], paired=False)[0])
    with pytest.raises(ValueError, match=r"equal lengths, got \[100, 50\]"):
        bootstrap_interval(diff, a, b[:50], paired=True)


def test_paired_ratio_of_pooled_sums():
    rng = np.random.default_rng(2)
    tokens = rng.integers(20, 100, 30).astype(float)
    base_wall = tokens * 0.05 * rng.uniform(0.5, 1.5, 30)
    fast_wall = base_wall / 2 * rng.uniform(0.9, 1.1, 30)  # twice as fast on every prompt, +-10%
    lo, hi = paired_ratio_interval(tokens, fast_wall, tokens, base_wall)
    point = pooled_ratio(tokens, fast_wall) / pooled_ratio(tokens, base_wall)
    assert lo < point < hi and 1.9 < lo and hi < 2.1
    assert paired_ratio_interval(tokens, base_wall, tokens, base_wall) == pytest.approx((1.0, 1.0))
    assert all(math.isnan(v) for v in paired_ratio_interval(tokens[:1], fast_wall[:1], tokens[:1], base_wall[:1]))


def test_bad_arguments_are_named():
    x = np.arange(10.0)
    with pytest.raises(ValueError, match="'bca'"):
        bootstrap_interval(mean, x, method="bca")
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval(mean, x, level=95)
    with pytest.raises(ValueError, match="1-D"):
        bootstrap_interval(mean, x.reshape(2, 5))
