"""LightningModule: the acceptance head trained with the weighted soft-label BCE."""

from __future__ import annotations

import math
from collections.abc import Callable

import lightning as L
import torch
from torchmetrics import MinMetric

from specdecpp.stopping.head import AcceptanceHead
from specdecpp.training.loss import weighted_bce
from specdecpp.training.mixing import FIXED_MIXING_EPOCH, mixed_features
from specdecpp.training.schedules import warmup_cosine

from .metrics import head_metrics


def training_spec(head: AcceptanceHead, feature_context: str = "mixed") -> dict:
    """The head's feature spec plus where train computes its features (``data.feature_context``;
    the default ``mixed`` adds nothing, so caches and records of earlier heads stay as they were)."""
    spec = head.feature_spec()
    return spec if feature_context == "mixed" else {**spec, "context": feature_context}


class FrozenDraft:
    """Holds the draft outside the module tree: never trained, never saved in checkpoints."""

    def __init__(self, model) -> None:
        self.model = model


class AcceptanceHeadModule(L.LightningModule):
    """Trains ``head`` on draft features at the Y-positions of mixed sequences.

    Batches are cached features or raw rows (see train/data.py); raw rows are mixed here with the
    epoch's mask (``remix_each_epoch``) or the fixed one, and fed to the frozen draft.
    """

    def __init__(self, head: AcceptanceHead, *, optimizer: Callable, w_rej: float, w_acc: float = 1.0,
                 warmup_ratio: float = 0.03, mix_ratio: float = 0.15, mix_seed: int = 0,
                 remix_each_epoch: bool = False, draft=None, feature_context: str = "mixed") -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["head", "optimizer", "draft"], logger=False)
        self.hparams.update(hidden_size=head.hidden_size, depth=head.depth, head_kind=head.kind)
        self.head = head
        self.optimizer_factory = optimizer
        self.draft = FrozenDraft(draft)
        self.train_metrics = head_metrics("train/", full=False)
        self.val_metrics = head_metrics("val/")
        self.val_kl_best = MinMetric()
        self.eval_names: list[str] = []
        self.eval_metrics = torch.nn.ModuleList()
        self.eval_results: dict[str, dict] = {}
        self.training_identity: dict | None = None  # set by train.app; saved in every checkpoint
        # val/loss of each epoch: the weighted BCE over all validation positions (of every rank),
        # logged once per epoch; early stopping and the best-weights ModelCheckpoint monitor it
        self.val_loss_per_epoch: list[float] = []
        self._val_sum, self._val_count = 0.0, 0

    # -- features and loss ---------------------------------------------------------------------
    def features(self, batch: dict, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not batch:  # a DDP rank's empty share of a small global batch (train/data.py rank_share)
            return torch.zeros(0, self.head.hidden_size, device=self.device), torch.zeros(0, device=self.device)
        if "hidden" in batch:
            return batch["hidden"], batch["labels"]
        draft = self.draft.model
        if draft is None:
            raise RuntimeError("raw batches need the draft model: pass draft= to AcceptanceHeadModule")
        if draft.device != self.device:
            draft.to(self.device)
        rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        hidden, labels = mixed_features(draft, rows, self.hparams.mix_ratio, self.hparams.mix_seed, epoch,
                                        spec=training_spec(self.head, self.hparams.feature_context))
        return torch.cat(hidden), torch.cat(labels).to(self.device)

    def model_step(self, batch: dict, epoch: int = FIXED_MIXING_EPOCH):
        hidden, labels = self.features(batch, epoch)
        logits = self.head(hidden).float()
        loss = weighted_bce(logits, labels, self.hparams.w_rej, self.hparams.w_acc)
        return loss, logits.detach(), labels

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        epoch = self.current_epoch if self.hparams.remix_each_epoch else FIXED_MIXING_EPOCH
        loss, logits, labels = self.model_step(batch, epoch)
        if self.trainer.world_size > 1:  # DDP averages the ranks' gradients: make that the global batch's
            total_weight = self.global_totals(loss, labels)[1].clamp_min(1e-30)
            loss = loss * (self.label_weight(labels).double() * self.trainer.world_size / total_weight).float()
        self.train_metrics.update(logits, labels)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=labels.numel(),
                 sync_dist=True)
        self.log_dict(self.train_metrics, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def label_weight(self, labels: torch.Tensor) -> torch.Tensor:
        """weighted_bce's normaliser: w_rej sum(1 - P) + w_acc sum(P)."""
        labels = labels.float()
        return self.hparams.w_rej * (1 - labels).sum() + self.hparams.w_acc * labels.sum()

    def global_totals(self, loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(loss x label weight, label weight, positions) summed over the DDP ranks' shares of one
        global batch: the one-process batch loss is totals[0] / totals[1]. A rank's loss alone is
        normalised by its own share's label weight (weighted_bce)."""
        weight = self.label_weight(labels)
        local = torch.stack([loss.detach().double() * weight, weight.double(),
                             torch.tensor(float(labels.numel()), dtype=torch.float64, device=weight.device)])
        return self.trainer.strategy.reduce(local, reduce_op="sum")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, logits, labels = self.model_step(batch)
        self.val_metrics.update(logits, labels)
        positions = labels.numel()
        if self.trainer.world_size > 1:  # the one-process batch loss and size, on every rank
            totals = self.global_totals(loss, labels)
            loss, positions = totals[0] / totals[1].clamp_min(1e-30), int(totals[2])
        self._val_sum += float(loss) * positions
        self._val_count += positions

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking and self._val_count > 0:
            epoch_loss = self._val_sum / self._val_count  # the same on every rank: the one-process value
            self.val_loss_per_epoch.append(epoch_loss)
            self.log("val/loss", epoch_loss, prog_bar=True, sync_dist=True)
        self._val_sum, self._val_count = 0.0, 0
        values = self.val_metrics.compute()
        self.val_metrics.reset()
        if not math.isnan(float(values["val/KL"])):
            self.val_kl_best.update(values["val/KL"])
        self.log_dict({**values, "val/KL_best": self.val_kl_best.compute()}, prog_bar=True)

    # -- checkpoints -----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.training_identity is not None:
            checkpoint["specdecpp_training_identity"] = self.training_identity
        checkpoint["specdecpp_val_loss_per_epoch"] = self.val_loss_per_epoch

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.val_loss_per_epoch = list(checkpoint.get("specdecpp_val_loss_per_epoch", []))

    # -- final evaluation on named splits (trainer.test with one loader per split) -------------
    def set_eval_splits(self, names: list[str]) -> None:
        self.eval_names = list(names)
        self.eval_metrics = torch.nn.ModuleList(head_metrics(f"{name}/") for name in names).to(self.device)
        self.eval_results = {}

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        _, logits, labels = self.model_step(batch)
        self.eval_metrics[dataloader_idx].update(logits, labels)

    def on_test_epoch_end(self) -> None:
        for name, metrics in zip(self.eval_names, self.eval_metrics, strict=True):
            values = {key.split("/", 1)[1]: float(v) for key, v in metrics.compute().items()}  # over all ranks
            with metrics["KL"].sync_context(), metrics["ECE"].sync_context():  # raw states over all ranks too
                values["positions"] = int(metrics["KL"].count)
                self.eval_results[name] = {**values, "calibration_bins": metrics["ECE"].bins()}
            self.log_dict({f"final/{name}/{k}": v for k, v in values.items()}, add_dataloader_idx=False)

    # -- optimisation --------------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self.head.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_factor(self, step: int) -> float:
        """Linear warmup over ``warmup_ratio`` of the steps, then cosine decay to 0 (as
        transformers' cosine schedule). The step total is asked for lazily: asking Lightning while
        optimizers are configured loads the train loader before a checkpoint's loader position
        is restored, and a resumed run would restart its epoch."""
        if step == 0:
            return 0.0 if self.hparams.warmup_ratio > 0 else 1.0
        total = max(1, int(self.trainer.estimated_stepping_batches))
        return warmup_cosine(step, math.ceil(self.hparams.warmup_ratio * total), total)
