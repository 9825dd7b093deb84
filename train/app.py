"""``run(cfg)``: train one acceptance head from a composed train config (conf/train.yaml)."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from specdecpp.core.sampling import SamplingConfig
from specdecpp.data.dataset import dataset_fingerprint
from specdecpp.models.fit import config_hidden_size
from specdecpp.models.identity import same_model
from specdecpp.models.loading import load_config, load_model
from specdecpp.stopping.head import build_head
from specdecpp.training.mixing import check_context

from .checks import check_draft_matches, check_settings, check_split, load_dataset_dir
from .data import HeadDataConfig
from .module import training_spec
from .plots import plot_calibration

log = logging.getLogger(__name__)


def _instantiate_all(group: DictConfig | None) -> list:
    """Instantiate every non-null entry of a config group mapping (callbacks, loggers)."""
    return [instantiate(node) for node in (group or {}).values() if node is not None]


# Keys of the composed config that do not change what is trained (where files go, how progress
# is shown, how the work is spread): everything else is part of a run's identity.
NOT_IDENTITY = {"out", "experiment_name", "head.name_prefix", "logger", "hydra", "pair.device", "pair.name",
                "pair.target", "data.path", "data.num_workers", "data.cache_dir", "data.feature_batch_size",
                "data.allow_draft_mismatch", "trainer.default_root_dir", "trainer.enable_progress_bar",
                "trainer.enable_model_summary", "trainer.log_every_n_steps", "trainer.accelerator",
                "trainer.devices", "trainer.num_nodes", "trainer.strategy", "trainer.use_distributed_sampler",
                "trainer.num_sanity_val_steps", "callbacks.checkpoint", "best_checkpoint.dirpath",
                "callbacks.lr_monitor", "callbacks.progress_bar"}
# Config nodes whose values follow public keys by interpolation (model: loss.w_rej, ...): such a
# value is part of the identity through its source; a value set on the node itself is its own key.
DERIVED = ("model", "datamodule")
IDENTITY_KEY = "specdecpp_training_identity"
# Settings added after checkpoints were written: at these values (today's behaviour) they stay out
# of the identity, so a run begun before they existed still resumes.
NEWER_DEFAULTS = {"data.feature_context": "mixed", "model.feature_context": "mixed", "head.top_m": 8}


def _flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        flat = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: node}


def training_identity(cfg: DictConfig, dataset_fingerprint: str, draft_ref: str) -> dict:
    """What makes two runs the same run: the dataset's fingerprint, the draft and every setting
    that changes training (flattened dotted keys), so that only the same run resumes."""
    flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
    derived = {f"{group}.{key}" for group in DERIVED if group in cfg for key in cfg[group]
               if OmegaConf.is_interpolation(cfg[group], key)}
    identity = {k: v for k, v in flat.items()
                if not any(k == skip or k.startswith(skip + ".") for skip in NOT_IDENTITY | derived)}
    identity = {k: v for k, v in identity.items() if NEWER_DEFAULTS.get(k, object()) != v}
    identity.update({"dataset_fingerprint": dataset_fingerprint, "pair.draft": str(draft_ref)})
    return dict(sorted(identity.items()))


def same_setting(key: str, saved, now) -> bool:
    """Whether a training identity's ``key`` has the same value in a checkpoint (``saved``) and now. The
    draft may be named another way (:func:`specdecpp.models.identity.same_model`: a relative or absolute path
    to one local directory, as two spellings of ``SPECDECPP_CACHE`` give, or its portable identity)."""
    if saved == now:
        return True
    return key == "pair.draft" and isinstance(saved, str) and isinstance(now, str) and same_model(saved, now)


def _resume_checkpoint(callbacks: list, identity: dict) -> str | None:
    """``last.ckpt`` of the checkpoint callback if a previous run of the same training left one.

    A checkpoint of any other training (another dataset, head, schedule or seed; also a finished
    run, whose ``last.ckpt`` would otherwise be resumed at its last epoch and train nothing) is
    refused with the keys that differ."""
    checkpoint = next((c for c in callbacks if isinstance(c, ModelCheckpoint) and c.save_last), None)
    if checkpoint is None or checkpoint.dirpath is None:
        return None
    last = Path(checkpoint.dirpath) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
    if not last.is_file():
        return None
    saved = torch.load(last, map_location="cpu", weights_only=False).get(IDENTITY_KEY)
    if saved is None:
        differ = ["(the checkpoint records no training identity: it was written by an older version)"]
    else:
        differ = [f"{k}: {saved.get(k, '<unset>')!r} there, {identity.get(k, '<unset>')!r} now"
                  for k in sorted(set(saved) | set(identity))
                  if not same_setting(k, saved.get(k, "<unset>"), identity.get(k, "<unset>"))]
    if differ:
        raise ValueError(f"{last} is a checkpoint of a different training run; it differs in: {'; '.join(differ)}. "
                         f"Either choose another out=... for this run, or delete {last.parent} to start over "
                         "in this directory (rerun the original command instead to resume that run)")
    log.info("resuming from %s", last)
    return str(last)


def _training_record(cfg: DictConfig, meta: dict, trainer, module, weights: str, best_epoch: int | None) -> dict:
    """How the head was made, for its config.json."""
    data, loss = cfg.data, cfg.loss
    return {"weights": weights, "best_epoch": best_epoch,
            "val_loss_per_epoch": module.val_loss_per_epoch, "dataset": str(data.path), "w_rej": float(loss.w_rej),
            "w_acc": float(loss.w_acc), "depth": int(cfg.head.depth), "head_kind": str(cfg.head.get("kind", "resnet")),
            "mix_ratio": float(data.mix_ratio), "mix_seed": int(data.mix_seed),
            "seed": int(cfg.seed), "lr": float(cfg.optimizer.lr), "warmup_ratio": float(cfg.scheduler.warmup_ratio),
            "batch_size": int(data.batch_size), "epochs_done": int(trainer.current_epoch),
            "global_step": int(trainer.global_step), "cache_features": bool(data.cache_features),
            "remix_each_epoch": bool(data.remix_each_epoch), "experiment": cfg.experiment_name,
            **({"feature_context": str(data.feature_context)}
               if data.get("feature_context", "mixed") != "mixed" else {}),
            "dataset_meta": {k: meta.get(k)
                             for k in ("draft", "target", "sampling", "prompts", "seed", "labels", "joined")
                             if k not in ("labels", "joined") or meta.get(k) is not None}}


HOLDOUT_SPLIT = "val"


def make_head(head_cfg: DictConfig, hidden_size: int, draft_ref: str, meta: dict):
    """The head of ``head.kind`` (conf/head/): ``resnet`` (the paper's) or ``next`` (lag-free; its
    q features use the temperature the dataset was sampled at)."""
    kind = head_cfg.get("kind", "resnet")
    if kind == "resnet":
        return build_head(kind, hidden_size, int(head_cfg.depth), draft=draft_ref)
    temperature = SamplingConfig.from_mapping(meta.get("sampling") or {}).temperature
    extra = {"top_m": int(head_cfg.top_m)} if head_cfg.get("top_m") is not None else {}
    return build_head(kind, hidden_size, int(head_cfg.depth), draft=draft_ref,
                      features=tuple(head_cfg.features), temperature=temperature, **extra)


def validation_split(splits, data: DictConfig):
    """``(splits, val_split, record)``. A dataset without the ``data.val_split`` split (e.g. data_gen
    with splits=[train]) validates on a held-out slice of the train split: ``data.val_fraction`` of
    its prompts, drawn from ``data.val_seed``, trained on by no step. The record (for config.json)
    names the slice; otherwise it is None."""
    val_split = data.val_split
    if val_split is None or val_split in splits or data.train_split not in splits:
        return splits, val_split, None
    fraction, seed = float(data.val_fraction), int(data.val_seed)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {fraction!r} (or set data.val_split=null)")
    train = splits[data.train_split]
    n_val = max(1, round(fraction * len(train)))
    if len(train) - n_val < 1:
        raise ValueError(f"split {data.train_split!r} has {len(train)} prompt(s): too few to hold out a validation "
                         "slice; add a dev split or set data.val_split=null")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    val_rows, train_rows = sorted(order[:n_val]), sorted(order[n_val:])
    log.warning("the dataset has no %r split: validating on %d of the %d %r prompts (data.val_fraction=%g, "
                "data.val_seed=%d), held out from training", val_split, n_val, len(train), data.train_split,
                fraction, seed)
    record = {"split": HOLDOUT_SPLIT, "held_out_from": data.train_split, "fraction": fraction, "seed": seed,
              "rows": n_val}
    splits = {**splits, data.train_split: train.select(train_rows), HOLDOUT_SPLIT: train.select(val_rows)}
    record["ids"] = list(splits[HOLDOUT_SPLIT]["id"])
    return splits, HOLDOUT_SPLIT, record


def feature_draft_loaders(cfg: DictConfig, meta: dict, draft_ref: str):
    """(load target, load draft) for a feature draft's labels, after the settings it needs are
    checked: either head kind in the labels' own context, on cached features (its features come
    from the target's forward and the draft unrolled by depth, specdecpp.training.mixing)."""
    kind, context = str(cfg.head.get("kind", "resnet")), str(cfg.data.get("feature_context", "mixed"))
    if context != "target" or not cfg.data.cache_features:
        raise ValueError(f"dataset {str(cfg.data.path)!r} labels a feature draft (depths 1..{meta['feature_depths']}): "
                         "its heads (head=next or head=resnet) train with data.feature_context=target and "
                         f"data.cache_features=true (got head {kind!r}, feature_context {context!r}, cache_features "
                         f"{cfg.data.cache_features}); docs/feature_draft.md")
    if not meta.get("target"):
        raise ValueError(f"dataset {str(cfg.data.path)!r} records no target in its meta: a feature draft's "
                         "features need it")
    from specdecpp.models.feature_draft import FeatureDraft
    from specdecpp.models.identity import resolve_model

    load_target = functools.cache(lambda: load_model(str(meta["target"]), device=cfg.pair.device,
                                                     dtype=cfg.pair.dtype))
    return load_target, functools.cache(lambda: FeatureDraft.from_pretrained(resolve_model(draft_ref),
                                                                             target=load_target()))


def run(cfg: DictConfig) -> dict:
    """Train, evaluate on every split, save the head to ``cfg.out``; return a summary dict."""
    data, loss = cfg.data, cfg.loss
    check_settings(loss.w_rej, loss.w_acc, data.mix_ratio, data.mix_seed, cfg.head.depth, data.batch_size,
                   data.cache_features, data.remix_each_epoch)
    if cfg.weights not in ("best_val", "last"):
        raise ValueError(f"weights must be best_val or last, got {cfg.weights!r}")
    out = Path(cfg.out)
    splits, meta = load_dataset_dir(None if OmegaConf.is_missing(data, "path") else data.path)
    if OmegaConf.is_missing(cfg.pair, "draft"):  # the draft that labelled the dataset, from its meta
        if not meta.get("draft"):
            raise ValueError(f"pair.draft is not set and dataset {str(data.path)!r} records no draft in its meta: "
                             "pass pair=demo, or pair=custom pair.draft=PATH (the draft that labelled the dataset)")
        cfg.pair.draft = str(meta["draft"])
        log.info("pair.draft from the dataset's meta: %s", cfg.pair.draft)
    draft_ref = str(cfg.pair.draft)
    original_splits = splits
    splits, val_split, holdout = validation_split(splits, data)
    L.seed_everything(cfg.seed, workers=True)
    # the weights load only where the draft runs: building a feature cache, or raw batches
    load_draft = functools.cache(lambda: load_model(draft_ref, device=cfg.pair.device, dtype=cfg.pair.dtype))
    load_target = None
    if meta.get("feature_depths"):  # a feature draft's labels: its features need the target too
        load_target, load_draft = feature_draft_loaders(cfg, meta, draft_ref)
    draft_config = load_config(draft_ref)
    hidden_size = config_hidden_size(draft_config)
    check_draft_matches(meta, draft_ref, hidden_size, str(data.path), data.allow_draft_mismatch)
    vocab = int(draft_config.vocab_size)
    for name in splits:
        check_split(splits[name], name, str(data.path), vocab)

    head = make_head(cfg.head, hidden_size, draft_ref, meta)
    feature_context = str(data.get("feature_context", "mixed"))
    spec = training_spec(head, feature_context)
    # a bad context, or the paper's head in the target context of a plain draft: an error before any work
    check_context(spec, feature_draft=bool(meta.get("feature_depths")))
    datamodule = instantiate(cfg.datamodule)(splits, HeadDataConfig.from_cfg(cfg, val_split), draft=load_draft,
                                             draft_ref=draft_ref, feature_spec=spec, feature_size=head.feature_size,
                                             target=load_target)
    module = instantiate(cfg.model)(head=head, draft=None if data.cache_features else load_draft())

    callbacks = _instantiate_all(cfg.get("callbacks"))
    best = instantiate(cfg.best_checkpoint) if cfg.weights == "best_val" and val_split is not None else None
    if best is not None:
        callbacks.append(best)
    identity = training_identity(cfg, dataset_fingerprint(original_splits, meta), draft_ref)
    identity["hidden_size"] = hidden_size
    module.training_identity = identity
    resume = _resume_checkpoint(callbacks, identity)  # before any logger writes into out
    loggers = _instantiate_all(cfg.get("logger"))
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    if not loggers:  # LearningRateMonitor refuses to run without a logger
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    weights, best_epoch = "last", None
    if best is not None and best.best_model_path:  # the monitored best epoch's weights
        saved = torch.load(best.best_model_path, map_location="cpu", weights_only=False)
        module.load_state_dict(saved["state_dict"])
        weights, best_epoch = "best_val", int(saved["epoch"])
        log.info("keeping the weights of epoch %d (best %s %.5f)", best_epoch, best.monitor,
                 float(best.best_model_score))

    eval_splits = [name for name in ("train", HOLDOUT_SPLIT, "dev", "test") if name in splits]
    module.set_eval_splits(eval_splits)
    trainer.test(module, dataloaders=[datamodule.loader(name) for name in eval_splits], verbose=False)
    results = module.eval_results
    metrics = {split: {k: v for k, v in values.items() if k != "calibration_bins"} for split, values in results.items()}

    if not trainer.is_global_zero:  # DDP: every rank trained and evaluated the same head; rank 0 saves it
        return {"out": str(out), "metrics": metrics, "global_step": int(trainer.global_step),
                "trainer": trainer, "module": module}
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_calibration(results, out / "calibration.png", title=f"{cfg.experiment_name} (D={cfg.head.depth}, "
                                                                      f"w_rej={loss.w_rej})")
    training = _training_record(cfg, meta, trainer, module, weights, best_epoch)
    if holdout is not None:
        training["validation"] = holdout
        (out / "validation_ids.json").write_text(json.dumps(holdout["ids"]) + "\n")
    head.save_pretrained(out, training=training, metrics=metrics, target=meta.get("target"))
    (out / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
    OmegaConf.save(cfg, out / "train_config.yaml")
    log.info("saved head to %s (%s)", out, ", ".join(f"{s}/KL {m['KL']:.4f}" for s, m in metrics.items()))
    return {"out": str(out), "metrics": metrics, "calibration_plot": str(plot),
            "global_step": int(trainer.global_step), "trainer": trainer, "module": module}
