"""torchmetrics wrappers over specdecpp.training.metrics for soft acceptance labels.

Every metric takes ``update(logits, p_acc)``: head logits and soft labels P_i in [0, 1].
"""

from __future__ import annotations

import torch
from torchmetrics import Metric, MetricCollection

from specdecpp.training.metrics import (
    binary_entropy,
    binary_kl,
    calibration_bins,
    expected_calibration_error,
    rejection_auroc,
)


class BinaryKL(Metric):
    """Mean over positions of KL(P || sigmoid(logit)), unweighted (the paper's Table 3 KL)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, p_acc: torch.Tensor) -> None:
        self.total += binary_kl(logits, p_acc).double().sum()
        self.count += p_acc.numel()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count).float() if self.count > 0 else torch.tensor(float("nan"))


class ConstantKL(Metric):
    """KL of the best constant predictor c = mean(P) on the same positions: H(c) - mean H(P).
    A head that learned anything has a lower KL than this."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        for name in ("sum_label", "sum_entropy"):
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, p_acc: torch.Tensor) -> None:
        self.sum_label += p_acc.double().sum()
        self.sum_entropy += binary_entropy(p_acc).double().sum()
        self.count += p_acc.numel()

    def compute(self) -> torch.Tensor:
        if self.count == 0:
            return torch.tensor(float("nan"))
        c = self.sum_label / self.count
        return (binary_entropy(c) - self.sum_entropy / self.count).float()


class SoftCalibrationError(Metric):
    """Expected calibration error of P_hat against soft labels (15 equal-width bins, L1); the
    bin sums stay available for the reliability diagram (:meth:`bins`)."""

    full_state_update = False

    def __init__(self, n_bins: int = 15) -> None:
        super().__init__()
        self.n_bins = n_bins
        for name in ("count", "sum_prob", "sum_label"):
            self.add_state(name, torch.zeros(n_bins + 1, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, p_acc: torch.Tensor) -> None:
        count, sum_prob, sum_label = calibration_bins(torch.sigmoid(logits.float()), p_acc, self.n_bins)
        self.count += count.double()
        self.sum_prob += sum_prob.double()
        self.sum_label += sum_label.double()

    def compute(self) -> torch.Tensor:
        return expected_calibration_error(self.count, self.sum_prob, self.sum_label).float()

    def bins(self) -> dict[str, list[float]]:
        return {"count": self.count.tolist(), "sum_prob": self.sum_prob.tolist(),
                "sum_label": self.sum_label.tolist()}


class RejectionAUROC(Metric):
    """AUROC of -logit as a score for rejection; each position counts as a rejection with weight
    1 - P_i and as an acceptance with weight P_i (see specdecpp.training.metrics.rejection_auroc)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("logits", [], dist_reduce_fx="cat")
        self.add_state("labels", [], dist_reduce_fx="cat")

    def update(self, logits: torch.Tensor, p_acc: torch.Tensor) -> None:
        self.logits.append(logits.detach().float().flatten())
        self.labels.append(p_acc.detach().float().flatten())

    def compute(self) -> torch.Tensor:
        if isinstance(self.logits, list):  # one process; across DDP ranks the states arrive concatenated
            if not self.logits:
                return torch.tensor(float("nan"))
            return rejection_auroc(torch.cat(self.logits), torch.cat(self.labels))
        return rejection_auroc(self.logits, self.labels)


def head_metrics(prefix: str, full: bool = True) -> MetricCollection:
    """KL (and, if ``full``, the constant-predictor KL, ECE and rejection AUROC) under ``prefix``."""
    metrics = {"KL": BinaryKL()}
    if full:
        metrics |= {"KL_const": ConstantKL(), "ECE": SoftCalibrationError(), "AUROC": RejectionAUROC()}
    return MetricCollection(metrics, prefix=prefix, compute_groups=False)
