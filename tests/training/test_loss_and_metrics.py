"""The training loss and the head metrics: weighted BCE (the authors' two-class form), binary KL,
calibration error and the rejection AUROC (soft labels), against hand computation and torchmetrics."""

from __future__ import annotations

import math

import pytest
import torch

from specdecpp.training.loss import weighted_bce
from specdecpp.training.metrics import (
    binary_entropy,
    binary_kl,
    calibration_bins,
    expected_calibration_error,
    rejection_auroc,
)
from train.metrics import RejectionAUROC, SoftCalibrationError


def test_weighted_bce_matches_hand_computation_and_authors_two_class_form():
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0])
    p = torch.tensor([1.0, 0.2, 0.7, 0.0])
    w_rej = 6.0
    q = [1 / (1 + math.exp(-v)) for v in logits.tolist()]
    num = sum(-pi * math.log(qi) - w_rej * (1 - pi) * math.log(1 - qi) for pi, qi in zip(p.tolist(), q, strict=True))
    den = w_rej * sum(1 - pi for pi in p.tolist()) + sum(p.tolist())
    assert weighted_bce(logits, p, w_rej).item() == pytest.approx(num / den, rel=1e-6)
    # the authors' formulation: 2-class CE with class weights [w_rej, 1], soft labels, same normaliser
    two_class = torch.stack([torch.zeros_like(logits), logits], dim=-1)
    ce = torch.nn.CrossEntropyLoss(weight=torch.tensor([w_rej, 1.0]), reduction="none")
    loss0, loss1 = ce(two_class, torch.zeros(4, dtype=torch.long)), ce(two_class, torch.ones(4, dtype=torch.long))
    authors = ((loss0 * (1 - p) + loss1 * p).sum() / (w_rej * (1 - p).sum() + p.sum())).item()
    assert weighted_bce(logits, p, w_rej).item() == pytest.approx(authors, rel=1e-6)
    empty = weighted_bce(torch.zeros(0, requires_grad=True), torch.zeros(0), w_rej)
    assert empty.item() == 0.0 and empty.requires_grad


def test_binary_kl_is_bce_minus_entropy():
    p = torch.tensor([0.0, 0.3, 0.9, 1.0])
    exact = torch.logit(torch.tensor([0.5, 0.3, 0.9, 0.5]))
    assert binary_kl(exact, p)[1:3].abs().max() < 1e-6  # zero where P_hat = P
    logits = torch.tensor([1.0, -0.5, 0.2, 3.0])
    q = torch.sigmoid(logits)
    kl = p * torch.log(torch.where(p > 0, p, 1) / q) + (1 - p) * torch.log(torch.where(p < 1, 1 - p, 1) / (1 - q))
    torch.testing.assert_close(binary_kl(logits, p), kl)
    assert binary_entropy(torch.tensor([0.0, 1.0, 0.5])).tolist() == pytest.approx([0, 0, math.log(2)])


def test_calibration_and_auroc_match_torchmetrics_on_hard_labels():
    from torchmetrics.classification import BinaryAUROC, BinaryCalibrationError

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(400, generator=g)
    hard = (torch.rand(400, generator=g) < torch.sigmoid(1.5 * logits)).float()
    ours = SoftCalibrationError()
    ours.update(logits[:150], hard[:150])
    ours.update(logits[150:], hard[150:])
    reference = BinaryCalibrationError(n_bins=15)(torch.sigmoid(logits), hard.long())
    assert ours.compute().item() == pytest.approx(reference.item(), abs=1e-6)
    auroc = RejectionAUROC()
    auroc.update(logits, hard)
    assert auroc.compute().item() == pytest.approx(BinaryAUROC()(-logits, (1 - hard).long()).item(), abs=1e-6)


def test_soft_auroc_equals_auroc_of_the_expanded_hard_labels():
    """A label P = 1/2 counts as half an acceptance and half a rejection: the same as listing every
    position twice, with hard labels (P >= 1/2, P == 1)."""
    from torchmetrics.classification import BinaryAUROC

    logits = torch.tensor([2.0, 1.0, 0.5, -0.3, -1.0, 0.5])
    soft = torch.tensor([1.0, 0.5, 0.0, 0.5, 0.0, 1.0])
    expanded = torch.cat([(soft >= 0.5).float(), (soft == 1.0).float()])
    reference = BinaryAUROC()(-torch.cat([logits, logits]), (1 - expanded).long())
    assert reference.item() != pytest.approx(0.5)
    assert rejection_auroc(logits, soft).item() == pytest.approx(reference.item(), abs=1e-6)
    count, sum_prob, sum_label = calibration_bins(torch.tensor([0.05, 0.06, 0.95]), torch.tensor([0.0, 0.5, 1.0]), 10)
    assert expected_calibration_error(count, sum_prob, sum_label).item() == pytest.approx((0.39 + 0.05) / 3)
