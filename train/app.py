"""``run(cfg)``: train one acceptance head from a composed train config (conf/train.yaml)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from specdecpp.head import AcceptanceHead
from specdecpp.models import load_model

from .checks import check_draft_matches, check_settings, check_split, load_dataset_dir
from .data import HeadDataModule
from .module import AcceptanceHeadModule
from .plots import plot_calibration

log = logging.getLogger(__name__)


def _instantiate_all(group: DictConfig | None) -> list:
    """Instantiate every non-null entry of a config group mapping (callbacks, loggers)."""
    return [instantiate(node) for node in (group or {}).values() if node is not None]


def _resume_checkpoint(callbacks: list, settings: dict) -> str | None:
    """``last.ckpt`` of the checkpoint callback if a previous run of this head left one."""
    checkpoint = next((c for c in callbacks if isinstance(c, ModelCheckpoint)), None)
    if checkpoint is None or checkpoint.dirpath is None:
        return None
    last = Path(checkpoint.dirpath) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
    if not last.is_file():
        return None
    saved = torch.load(last, map_location="cpu", weights_only=False).get("hyper_parameters", {})
    differ = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
    if differ:
        raise ValueError(f"{last} is a checkpoint of a different run ({', '.join(f'{k}: {a!r} there, {b!r} now' for k, (a, b) in differ.items())}); "
                         "choose another out=... or delete that checkpoint directory to start over")
    log.info("resuming from %s", last)
    return str(last)


def _training_record(cfg: DictConfig, meta: dict, trainer) -> dict:
    """How the head was made, for its config.json."""
    data, loss = cfg.data, cfg.loss
    return {"dataset": str(data.path), "w_rej": float(loss.w_rej), "w_acc": float(loss.w_acc),
            "depth": int(cfg.head.depth), "mix_ratio": float(data.mix_ratio), "mix_seed": int(data.mix_seed),
            "seed": int(cfg.seed), "lr": float(cfg.optimizer.lr), "warmup_ratio": float(cfg.scheduler.warmup_ratio),
            "batch_size": int(data.batch_size), "epochs_done": int(trainer.current_epoch),
            "global_step": int(trainer.global_step), "cache_features": bool(data.cache_features),
            "remix_each_epoch": bool(data.remix_each_epoch), "experiment": cfg.experiment_name,
            "dataset_meta": {k: meta.get(k) for k in ("draft", "target", "sampling", "prompts", "seed")}}


def run(cfg: DictConfig) -> dict:
    """Train, evaluate on every split, save the head to ``cfg.out``; return a summary dict."""
    data, loss = cfg.data, cfg.loss
    check_settings(loss.w_rej, loss.w_acc, data.mix_ratio, data.mix_seed, cfg.head.depth, data.batch_size,
                   data.cache_features, data.remix_each_epoch)
    if OmegaConf.is_missing(cfg.pair, "draft"):
        raise ValueError("pair.draft is not set: pass pair=demo, or pair=custom pair.draft=PATH (the draft that "
                         "labelled the dataset)")
    out = Path(cfg.out)
    splits, meta = load_dataset_dir(None if OmegaConf.is_missing(data, "path") else data.path)
    L.seed_everything(cfg.seed, workers=True)
    draft = load_model(cfg.pair.draft, device=cfg.pair.device, dtype=cfg.pair.dtype)
    hidden_size = int(draft.config.hidden_size)
    check_draft_matches(meta, cfg.pair.draft, hidden_size, str(data.path), data.allow_draft_mismatch)
    vocab = draft.get_input_embeddings().num_embeddings
    for name in splits:
        check_split(splits[name], name, str(data.path), vocab)

    datamodule = HeadDataModule(
        splits, train_split=data.train_split, val_split=data.val_split, draft=draft, draft_ref=cfg.pair.draft,
        batch_size=data.batch_size, num_workers=data.num_workers, mix_ratio=data.mix_ratio,
        mix_seed=data.mix_seed, seed=cfg.seed, cache_features=data.cache_features, cache_dir=data.cache_dir,
        cache_dtype=data.cache_dtype, feature_batch_size=data.feature_batch_size)
    head = AcceptanceHead(hidden_size, cfg.head.depth, draft=cfg.pair.draft)
    module = AcceptanceHeadModule(
        head, optimizer=instantiate(cfg.optimizer), w_rej=float(loss.w_rej), w_acc=float(loss.w_acc),
        warmup_ratio=cfg.scheduler.warmup_ratio, mix_ratio=data.mix_ratio, mix_seed=data.mix_seed,
        remix_each_epoch=data.remix_each_epoch, draft=None if data.cache_features else draft)

    loggers = _instantiate_all(cfg.get("logger"))
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    callbacks = _instantiate_all(cfg.get("callbacks"))
    if not loggers:  # LearningRateMonitor refuses to run without a logger
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    settings = {k: module.hparams[k] for k in ("w_rej", "w_acc", "depth", "hidden_size", "mix_ratio", "mix_seed")}
    trainer.fit(module, datamodule=datamodule, ckpt_path=_resume_checkpoint(callbacks, settings))

    eval_splits = [name for name in ("train", "dev", "test") if name in splits]
    module.set_eval_splits(eval_splits)
    trainer.test(module, dataloaders=[datamodule.loader(name) for name in eval_splits], verbose=False)
    results = module.eval_results
    metrics = {split: {k: v for k, v in values.items() if k != "calibration_bins"} for split, values in results.items()}

    out.mkdir(parents=True, exist_ok=True)
    plot = plot_calibration(results, out / "calibration.png", title=f"{cfg.experiment_name} (D={cfg.head.depth}, "
                                                                      f"w_rej={loss.w_rej})")
    training = _training_record(cfg, meta, trainer)
    head.save_pretrained(out, training=training, metrics=metrics, target=meta.get("target"))
    (out / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
    OmegaConf.save(cfg, out / "train_config.yaml")
    log.info("saved head to %s (%s)", out, ", ".join(f"{s}/KL {m['KL']:.4f}" for s, m in metrics.items()))
    return {"out": str(out), "metrics": metrics, "calibration_plot": str(plot),
            "global_step": int(trainer.global_step), "trainer": trainer, "module": module}
