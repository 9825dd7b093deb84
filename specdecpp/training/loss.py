"""The acceptance head's training loss (SpecDec++ Section 3.3): the weighted soft-label BCE.

Labels are P_i = min(1, p(Y_i)/q(Y_i)) at the Y-positions of a mixed sequence (specdecpp.training.mixing);
the head outputs a logit, P_hat = sigmoid(logit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weighted_bce(logits: torch.Tensor, p_acc: torch.Tensor, w_rej: float, w_acc: float = 1.0) -> torch.Tensor:
    """Soft-label weighted BCE, normalised by the label weight of the batch (authors' code):

        sum_i [ -w_acc P_i log P_hat_i - w_rej (1 - P_i) log(1 - P_hat_i) ] / (w_rej sum(1 - P) + w_acc sum(P))

    An empty batch (no Y-positions) gives a zero loss that still carries a graph.
    """
    logits, p = logits.float(), p_acc.float()
    if logits.numel() == 0:
        return logits.sum() * 0.0
    per_token = w_acc * p * F.softplus(-logits) + w_rej * (1 - p) * F.softplus(logits)
    return per_token.sum() / (w_rej * (1 - p).sum() + w_acc * p.sum())
