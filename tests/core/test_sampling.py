import math

import numpy as np
import pytest
import torch

from specdecpp.core.sampling import SamplingConfig, entropy, sample, warp
from specdecpp.core.verify import acceptance_ratio, residual, verify
from tests.helpers.stats import chi_square_pvalue


def _logits(v=10, seed=0):
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_one_hot_argmax():
    logits = _logits()
    probs = warp(logits, SamplingConfig(temperature=0))
    assert probs.sum() == 1 and probs[logits.argmax()] == 1


def test_temperature_matches_scaled_softmax():
    logits = _logits()
    np.testing.assert_allclose(warp(logits, SamplingConfig(temperature=0.7)).numpy(),
                               torch.softmax(logits / 0.7, -1).numpy(), rtol=1e-6)


def test_top_k_keeps_the_k_largest_renormalised():
    logits = _logits(12)
    probs = warp(logits, SamplingConfig(top_k=4))
    keep = set(torch.topk(logits, 4).indices.tolist())
    assert {i for i, p in enumerate(probs.tolist()) if p > 0} == keep
    expected = torch.softmax(logits[sorted(keep)], -1)
    np.testing.assert_allclose(probs[sorted(keep)].numpy(), expected.numpy(), rtol=1e-6)


def test_top_k_larger_than_vocab_means_no_truncation():
    logits = _logits(6)
    np.testing.assert_allclose(warp(logits, SamplingConfig(top_k=50)).numpy(),
                               torch.softmax(logits, -1).numpy(), rtol=1e-6)


def test_top_p_keeps_the_smallest_nucleus():
    logits = _logits(12, seed=3)
    full = torch.softmax(logits, -1).numpy()
    order = np.argsort(-full)
    # independent: smallest prefix of the sorted tokens whose mass reaches top_p
    for top_p in (0.3, 0.6, 0.9, 0.999):
        n_keep = int(np.searchsorted(np.cumsum(full[order]), top_p) + 1)
        kept = set(order[:n_keep].tolist())
        probs = warp(logits, SamplingConfig(top_p=top_p)).numpy()
        assert {i for i, p in enumerate(probs) if p > 0} == kept
        np.testing.assert_allclose(probs[list(kept)], full[list(kept)] / full[list(kept)].sum(), rtol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(temperature=float("nan"))])
def test_sampling_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_entropy_is_natural_log_of_full_softmax():
    logits = _logits()
    p = torch.softmax(logits, -1).numpy()
    assert math.isclose(float(entropy(logits)), float(-(p * np.log(p)).sum()), rel_tol=1e-5)
    assert math.isclose(float(entropy(logits, 0.0)), float(entropy(logits, 1.0)))  # greedy: raw softmax


def test_acceptance_ratio_and_residual():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.25, 0.6, 0.15]])
    assert acceptance_ratio(p, q, torch.tensor([0])).item() == 1.0
    assert acceptance_ratio(p, q, torch.tensor([1])).item() == pytest.approx(0.5)
    np.testing.assert_allclose(residual(p, q).numpy(), [[0.25 / 0.3, 0.0, 0.05 / 0.3]], rtol=1e-6)


def _random_dists(k, v, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, v, generator=g) * 1.5, -1)
    return p, q


@pytest.mark.parametrize("k", [1, 2, 3])
def test_verify_first_token_has_target_distribution(k):
    """Draft y ~ q, verify: the first emitted token is distributed as p_1, whatever q is."""
    p, q = _random_dists(k, 5, seed=k)
    g = torch.Generator().manual_seed(100 + k)
    firsts, drafted = [], []
    for _ in range(6000):
        y = sample(q, g)
        n_acc, nxt = verify(y, q, p, g)
        firsts.append(int(y[0]) if n_acc >= 1 else nxt)
        drafted.append(int(y[0]))
    expected = dict(enumerate(p[0].tolist()))
    assert chi_square_pvalue(firsts, expected) > 1e-4
    # negative control: the same test rejects the draft's own samples
    assert chi_square_pvalue(drafted, expected) < 1e-6


def test_verify_greedy_is_argmax_agreement():
    p = torch.eye(4)[[2, 1, 3]]           # target argmax: 2, 1, then 3
    q = torch.full((2, 4), 0.25)
    assert verify(torch.tensor([2, 1]), q, p, greedy=True) == (2, 3)
    assert verify(torch.tensor([2, 0]), q, p, greedy=True) == (1, 1)
    assert verify(torch.tensor([0, 1]), q, p, greedy=True) == (0, 2)


def test_verify_rejects_bad_shapes():
    p, q = _random_dists(2, 5, 0)
    with pytest.raises(ValueError, match="K\\+1"):
        verify(torch.tensor([1, 2]), q, p[:2])
