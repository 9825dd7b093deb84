"""Metrics of an acceptance head against soft labels P_i in [0, 1] (head logits, P_hat = sigmoid):
binary KL (the paper's Table 3 KL), calibration bins and ECE, and the rejection AUROC. Pure tensor
functions; train/metrics.py wraps them as torchmetrics for training and evaluation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """H(P) in nats, with 0 log 0 = 0."""
    p = p.float()
    return -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))


def binary_kl(logits: torch.Tensor, p_acc: torch.Tensor) -> torch.Tensor:
    """Per-position KL(P || P_hat) = BCE(P, P_hat) - H(P) (unweighted; the paper's train/eval KL)."""
    logits, p = logits.float(), p_acc.float()
    bce = p * F.softplus(-logits) + (1 - p) * F.softplus(logits)
    return bce - binary_entropy(p)


def calibration_bins(prob: torch.Tensor, p_acc: torch.Tensor, n_bins: int = 15):
    """Per-bin (count, sum of predicted P_hat, sum of labels P) over equal-width bins of P_hat.

    Binning as torchmetrics' calibration error (``n_bins + 1`` slots; P_hat = 1 lands in the
    last). Soft labels enter as their expectation: P_i is the probability that the candidate is
    accepted, so the bin's mean label is its expected acceptance rate.
    """
    prob, p = prob.detach().float().flatten(), p_acc.detach().float().flatten()
    edges = torch.linspace(0, 1, n_bins + 1, device=prob.device)
    index = torch.bucketize(prob, edges, right=True) - 1
    zeros = torch.zeros(n_bins + 1, device=prob.device)
    return (zeros.scatter_add(0, index, torch.ones_like(prob)), zeros.scatter_add(0, index, prob),
            zeros.scatter_add(0, index, p))


def expected_calibration_error(count: torch.Tensor, sum_prob: torch.Tensor, sum_label: torch.Tensor) -> torch.Tensor:
    """ECE = sum_b (n_b / n) |mean P_hat_b - mean P_b| (L1), from :func:`calibration_bins` sums."""
    total = count.sum()
    if total == 0:
        return torch.tensor(float("nan"))
    return (sum_prob - sum_label).abs().sum() / total


def soft_auroc(scores: torch.Tensor, positive_weight: torch.Tensor, negative_weight: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve where each item counts as positive with weight ``positive_weight``
    and as negative with ``negative_weight`` (ties get half credit). With 0/1 weights this is the
    ordinary AUROC; with soft labels it is the AUROC expected over the labels' Bernoulli draws.
    NaN when either class has no weight."""
    scores, wp, wn = (t.detach().double().flatten() for t in (scores, positive_weight, negative_weight))
    total_p, total_n = wp.sum(), wn.sum()
    if total_p <= 0 or total_n <= 0:
        return torch.tensor(float("nan"))
    order = torch.argsort(scores, descending=True)
    _, group = torch.unique_consecutive(scores[order], return_inverse=True)
    n_groups = int(group.max()) + 1
    tp = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).scatter_add(0, group, wp[order])
    fp = torch.zeros_like(tp).scatter_add(0, group, wn[order])
    tpr = torch.cat([tp.new_zeros(1), tp.cumsum(0) / total_p])
    fpr = torch.cat([fp.new_zeros(1), fp.cumsum(0) / total_n])
    return torch.trapezoid(tpr, fpr).float()


def rejection_auroc(logits: torch.Tensor, p_acc: torch.Tensor) -> torch.Tensor:
    """How well the head ranks rejections: AUROC of the score -logit (predicted rejection) against
    the rejection event, each position weighted 1 - P_i as a rejection and P_i as an acceptance."""
    p = p_acc.float()
    return soft_auroc(-logits.float(), 1 - p, p)
