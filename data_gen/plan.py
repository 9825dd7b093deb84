"""What a data_gen run does: which prompts, cut into which shards, owned by which process, and
the dataset-level metadata that a resumed run must match."""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import specdecpp
from specdecpp.core.sampling import SAMPLER
from specdecpp.data.dataset import recorded_prompts, shard_done, shard_prompts
from specdecpp.data.prompts import (
    LONG_PROMPTS,
    Prompt,
    load_prompts,
    prompt_digest,
    source_file_digest,
)
from specdecpp.models.feature_draft import FeatureDraft
from specdecpp.models.identity import portable_name, same_model
from specdecpp.models.loading import dtype_name

log = logging.getLogger(__name__)

# A source's own splits when `splits` is null. A JSONL file is one training split unless its rows
# carry "split" fields (then pass splits=[train,dev,test]); evaluation sets keep prompts.split.
DEFAULT_SPLITS = {"bundled": ["train", "dev", "test"], "alpaca": ["train", "dev", "test"], "jsonl": ["train"]}
# What a meta key written before the key existed means (those datasets resume at that value)
META_DEFAULTS = {"long_prompts": "error", "feature_depths": None}
# Meta keys that may differ between a run and its resumption.
VOLATILE_META = ("created", "code_version", "complete", "rows", "fast",  # fast: the same data, to rounding
                 "prompts_sha256")  # the file may change where the prompts labelled do not (check_same_prompts)


@dataclass(frozen=True)
class Shard:
    split: str
    index: int             # within the split
    prompts: tuple[Prompt, ...]


def splits_of(cfg: DictConfig) -> list[str]:
    if cfg.splits is not None:
        splits = list(cfg.splits)
        if not splits or len(set(splits)) != len(splits):
            raise ValueError(f"splits={splits!r}: give a non-empty list of distinct split names")
        return splits
    return DEFAULT_SPLITS.get(cfg.prompts.source, [cfg.prompts.split])


def limit_of(cfg: DictConfig, split: str) -> int | None:
    """`limit` (an int for every split, or a {split: int} mapping) else prompts.limit."""
    limit = cfg.limit if cfg.limit is not None else cfg.prompts.get("limit")
    if isinstance(limit, DictConfig):
        return limit.get(split)
    return limit


def load_split_prompts(cfg: DictConfig) -> dict[str, list[Prompt]]:
    """The prompts of every split, in the source's order; ids unique across all splits."""
    prompts, seen = {}, {}
    for split in splits_of(cfg):
        prompts[split] = load_prompts(cfg.prompts.source, split=split, limit=limit_of(cfg, split),
                                      path=cfg.prompts.get("path"))
        for p in prompts[split]:
            if p.id in seen:
                raise ValueError(f"prompt id {p.id!r} is in split {seen[p.id]!r} and {split!r} of source "
                                 f"{cfg.prompts.source!r}; a JSONL file without 'split' fields is one "
                                 "split: pass splits=[train]")
            seen[p.id] = split
    return prompts


def plan_shards(prompts: dict[str, list[Prompt]], shard_size: int) -> list[Shard]:
    """Every split cut into consecutive shards of ``shard_size`` prompts, splits in order."""
    if not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be an integer >= 1, got {shard_size!r}")
    return [Shard(split, i // shard_size, tuple(items[i:i + shard_size]))
            for split, items in prompts.items() for i in range(0, len(items), shard_size)]


def owned_shards(shards: list[Shard], index: int, count: int) -> list[Shard]:
    """Shards of process ``index`` out of ``count``: every count-th shard, round robin."""
    if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
        raise ValueError(f"shard.index={index!r} / shard.count={count!r}: need 0 <= index < count")
    return [s for n, s in enumerate(shards) if n % count == index]


def shard_counts(prompts: dict[str, list[Prompt]], shard_size: int) -> dict[str, int]:
    return {split: -(-len(items) // shard_size) for split, items in prompts.items()}


def code_version() -> str:
    """specdecpp's version, plus the git commit of the checkout when there is one."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(specdecpp.__file__).parent,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{specdecpp.__version__}+g{commit}" if commit else specdecpp.__version__


def settings_meta(cfg: DictConfig) -> dict:
    """The settings that shape the data, known before any model is loaded."""
    prompts = OmegaConf.to_container(cfg.prompts, resolve=True)
    return {
        "draft": portable_name(str(cfg.pair.draft)),  # an identity or hub id where there is one, not a local path
        "target": portable_name(str(cfg.pair.target)),
        "sampling": specdecpp.SamplingConfig.from_mapping(cfg.sampling).to_dict(),
        "seed": int(cfg.seed),
        "prompts": {**prompts, "splits": splits_of(cfg),
                    "limit": {split: limit_of(cfg, split) for split in splits_of(cfg)}},
        "max_new_tokens": int(cfg.max_new_tokens),
        "shard_size": int(cfg.shard_size),
        # only when set, so datasets labelled before the option existed still resume
        **({"labels": {"cascade": cascade_of(cfg)}} if cascade_of(cfg) is not None else {}),
        "long_prompts": long_prompts_of(cfg),
    }


def long_prompts_of(cfg: DictConfig) -> str:
    """``long_prompts``: ``error`` (a prompt too long for the pair's context is refused before any
    model runs) or ``skip`` (left out of the dataset with a warning)."""
    value = cfg.get("long_prompts", "error")
    if value not in LONG_PROMPTS:
        raise ValueError(f"long_prompts must be one of {', '.join(LONG_PROMPTS)}, got {value!r}")
    return value


def cascade_of(cfg: DictConfig) -> dict | None:
    """``labels.cascade`` ({rule, alpha} or null) checked by specdecpp.Cascade, as a plain dict."""
    node = (cfg.get("labels") or {}).get("cascade")
    if node is None:
        return None
    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    unknown = set(spec) - {"rule", "alpha"}
    if unknown:
        raise ValueError(f"labels.cascade: unknown keys {sorted(unknown)}; give rule and alpha")
    specdecpp.Cascade(spec.get("rule"), spec.get("alpha"))
    return {"rule": spec["rule"], "alpha": spec["alpha"]}


def build_meta(cfg: DictConfig, draft, target, vocab: int) -> dict:
    """Everything saved in specdecpp_meta.json."""
    return {
        **settings_meta(cfg),
        "dtype": dtype_name(target.dtype),
        "fast": cfg.get("fast"),  # the target's sampling forwards (specdecpp.fast)
        # the draw behind every sampled token (a resume with another draw would mix two random streams);
        # not in settings_meta, so a complete dataset made before it was recorded still loads
        "sampler": SAMPLER,
        "prompts_sha256": source_file_digest(cfg.prompts.source, cfg.prompts.get("path")),  # the file read
        "draft_hidden_size": int(draft.config.hidden_size),
        # a feature draft is labelled at depths 1..D (the depth_* columns; specdecpp.data.labels.TokenLabels)
        "feature_depths": int(cfg.get("feature_depths", 4)) if isinstance(draft, FeatureDraft) else None,
        "vocab_size": int(vocab),
        "code_version": code_version(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "complete": False,
    }


def check_resumable(out: str, existing: dict, meta: dict) -> None:
    """Refuse to mix data made with different settings into one directory (compares the keys of
    ``meta``, which may be :func:`settings_meta` alone)."""
    def same(k: str) -> bool:  # models compare by identity (a dataset recorded by path still resumes)
        if k in ("draft", "target") and existing.get(k) is not None and meta[k] is not None:
            return same_model(str(existing[k]), str(meta[k]))
        return existing.get(k, META_DEFAULTS.get(k)) == meta[k]

    differ = sorted(k for k in meta if k not in VOLATILE_META and not same(k))
    if differ:
        detail = "; ".join(f"{k}: existing {existing.get(k)!r} vs now {meta.get(k)!r}" for k in differ)
        raise ValueError(f"out={out!r} already holds data made with other settings ({detail}). "
                         "Rerun with the original settings to resume, or choose another out directory.")


def check_same_prompts(out: str, shards: list[Shard], existing: dict, file_digest: str | None = None) -> None:
    """Refuse to resume ``out`` when the prompts it already labelled are not the prompts of this run:
    a prompt whose text changed under the same id (named with both digests), or done shards (or a
    complete dataset) that hold other prompts than this run puts there (prompts added, removed or
    reordered). Prompts not labelled yet may change freely; a changed prompts file whose labelled
    prompts are all the same is only logged."""
    def pairs(prompts) -> list[list[str]]:
        return [[p.id, prompt_digest(p)] for p in prompts]

    if existing.get("complete"):  # where -> ([id, digest] written, [id, digest] this run puts there)
        recorded = recorded_prompts(out)
        planned = {split: [p for s in shards if s.split == split for p in s.prompts]
                   for split in dict.fromkeys([*recorded, *(s.split for s in shards)])}
        compared = {f"split {split!r}": (recorded.get(split, []), pairs(ps)) for split, ps in planned.items()}
    else:
        compared = {f"shard {s.split}/{s.index:05d}": (shard_prompts(out, s.split, s.index)[0], pairs(s.prompts))
                    for s in shards if shard_done(out, s.split, s.index)}
    now = {p.id: prompt_digest(p) for s in shards for p in s.prompts}
    fresh = ("Restore the original prompts to resume, or start a fresh output: choose another out= directory "
             f"(or delete {out!r} to relabel everything)")
    for written, _ in compared.values():
        for pid, digest in written:
            if pid in now and now[pid] != digest:
                raise ValueError(f"out={out!r} already holds labels for prompt {pid!r} made from another text: its "
                                 f"digest there is {digest}, the prompts now give {now[pid]} (the prompts changed "
                                 f"since that prompt was labelled). {fresh}")
    for where, (written, wanted) in compared.items():
        if [list(p) for p in written] != wanted:
            ids, new = [p[0] for p in written], [p[0] for p in wanted]
            first = next((i for i, (a, b) in enumerate(zip(ids, new, strict=False)) if a != b), min(len(ids), len(new)))
            raise ValueError(f"out={out!r}: {where} holds {len(ids)} labelled prompt(s), but the prompts of this run "
                             f"put {len(new)} there, the first difference at position {first} ({_at(ids, first)} "
                             f"there, {_at(new, first)} now): prompts were added, removed or reordered since the "
                             f"run began. {fresh}")
    if existing.get("prompts_sha256") is not None and existing["prompts_sha256"] != file_digest:
        log.warning("the prompts file %s changed since %s was begun (SHA-256 %s then, %s now), but every prompt "
                    "labelled there is unchanged", existing.get("prompts", {}).get("path"), out,
                    existing["prompts_sha256"][:16], str(file_digest)[:16])


def _at(ids: list[str], i: int) -> str:
    return repr(ids[i]) if i < len(ids) else "none"
