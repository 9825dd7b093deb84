"""data_gen: sample target responses, label draft tokens with min(1, p/q), save shard by shard."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from specdecpp.core.sampling import SamplingConfig
from specdecpp.data.dataset import (
    META_FILE,
    consolidate,
    read_meta,
    save_shard,
    shard_done,
    write_meta,
)
from specdecpp.data.labels import (
    label_responses,
    prompt_generator,
    sample_responses_with_probs,
    shared_vocab,
)
from specdecpp.data.prompts import (
    context_limit,
    encode_prompt,
    prompt_digest,
    source_file_digest,
    too_long,
)
from specdecpp.decoders.cascade import Cascade
from specdecpp.fast.buckets import GRAPH_BACKENDS, check_fast
from specdecpp.fast.compiling import set_compile_options
from specdecpp.models.loading import eos_token_ids, load_pair, resolve_device

from .plan import (
    Shard,
    build_meta,
    cascade_of,
    check_resumable,
    check_same_prompts,
    load_split_prompts,
    long_prompts_of,
    owned_shards,
    plan_shards,
    settings_meta,
    shard_counts,
)
from .summary import write_summary

log = logging.getLogger(__name__)
LOCK_FILE = ".consolidate.lock"


@dataclass
class DataGenResult:
    out: Path
    complete: bool                      # the final DatasetDict exists
    rows: dict[str, int] = field(default_factory=dict)  # rows per split once complete
    n_prompts: int = 0                  # prompts labelled by this call
    n_tokens: int = 0                   # target tokens sampled by this call
    elapsed_s: float = 0.0              # time spent sampling and labelling

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")


class _Progress:
    """A tqdm bar over prompts that also shows target tokens/s."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, unit="prompt", desc="data_gen", disable=not enabled)
        self.tokens, self.prompts, self.start = 0, 0, time.perf_counter()

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self.bar.set_postfix_str(f"{self.tokens / max(time.perf_counter() - self.start, 1e-9):.1f} target tok/s",
                                 refresh=False)

    def add_prompts(self, n: int) -> None:
        self.prompts += n
        self.bar.update(n)


def label_shard(shard: Shard, draft, target, tokenizer, sampling: SamplingConfig, *, seed: int,
                max_new_tokens: int, batch_size: int, vocab: int, progress: _Progress,
                cascade: Cascade | None = None, fast: str | None = None,
                skip: frozenset[str] = frozenset(), depths: int = 4) -> list[dict]:
    """Rows of one shard, in prompt order, none for the prompts in ``skip``. Responses are sampled
    with ``batch_size`` rows continuously batched (a finished row's place goes to the next prompt,
    shortest prompts first), keeping the target's p_i, on the fast path's static batch runner with
    ``fast``; then labelled ``batch_size`` at a time (one draft forward), grouped by length to limit padding."""
    prompts = [p for p in shard.prompts if p.id not in skip]
    if not prompts:
        return []
    encoded = [encode_prompt(tokenizer, p.prompt) for p in prompts]
    eos = eos_token_ids(tokenizer, target)
    gens = [prompt_generator(seed, p.id, target.device) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    sampled, kept = sample_responses_with_probs(
        target, [encoded[i] for i in order], sampling, max_new_tokens, [gens[i] for i in order], eos_token_id=eos,
        vocab=vocab, on_tokens=progress.add_tokens, batch_size=batch_size, fast=fast)
    responses = dict(zip(order, sampled, strict=True))
    target_probs = dict(zip(order, kept, strict=True)) if kept is not None else None  # p_i: no 2nd target forward
    order = sorted(order, key=lambda i: len(encoded[i]) + len(responses[i]))
    rows: list[dict | None] = [None] * len(encoded)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        labels = label_responses(draft, target, [encoded[i] for i in batch], [responses[i] for i in batch], sampling,
                                 [gens[i] for i in batch], vocab=vocab,
                                 target_probs=None if target_probs is None else [target_probs[i] for i in batch],
                                 cascade=cascade, depths=depths)
        for i, lab in zip(batch, labels, strict=True):
            prompt = prompts[i]
            rows[i] = {"id": prompt.id, "prompt": prompt.prompt, "prompt_ids": encoded[i],
                       "target_ids": responses[i], "draft_ids": lab.draft_ids.tolist(),
                       "p_acc": lab.p_acc.tolist(), "draft_entropy": lab.draft_entropy.tolist()}
            if lab.depth_p_acc is not None:  # a feature draft: its labels at depths 1..D
                rows[i].update(depth_draft_ids=lab.depth_draft_ids.tolist(), depth_p_acc=lab.depth_p_acc.tolist(),
                               depth_draft_entropy=lab.depth_draft_entropy.tolist())
        progress.add_prompts(len(batch))
    return rows


def _check_out_dir(out: Path) -> dict | None:
    """The existing meta, or None for a new run; refuse a non-empty directory that is not ours."""
    existing = read_meta(out)
    # hidden names are temporary files of a process that is starting the same run
    if existing is None and out.exists() and any(not p.name.startswith(".") for p in out.iterdir()):
        raise FileExistsError(f"out={str(out)!r} exists, is not empty and has no {META_FILE}: it is not a "
                              "data_gen output; choose a new or empty directory")
    return existing


def _consolidate_once(out: Path, counts: dict[str, int], meta: dict) -> dict[str, int] | None:
    """Consolidate unless another process holds the lock, then summarise the labels;
    return rows per split, or None."""
    lock = out / LOCK_FILE
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        log.warning("%s exists: another process is consolidating %s. If none is (it crashed), delete "
                    "the lock file and rerun with consolidate_only=true", lock, out)
        return None
    try:
        if (read_meta(out) or {}).get("complete"):  # another process finished between our check and the lock
            return read_meta(out).get("rows", {})
        splits = consolidate(out, counts, meta)
    finally:
        os.close(fd)
        lock.unlink(missing_ok=True)
    write_summary(splits, out, f"{out.name}: draft {Path(str(meta.get('draft'))).name}, "
                               f"target {Path(str(meta.get('target'))).name}")
    return {s: len(d) for s, d in splits.items()}


def _check_settings(cfg: DictConfig) -> None:
    for key in ("max_new_tokens", "batch_size", "shard_size"):
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    long_prompts_of(cfg)
    fast = cfg.get("fast")
    check_fast("data_gen", fast, resolve_device(cfg.pair.get("device", "auto")) if fast in GRAPH_BACKENDS else None)


def _long_prompts(cfg: DictConfig, todo: list[Shard], draft, target, tokenizer) -> dict[str, int]:
    """The prompts of ``todo`` too long for the pair's context with ``max_new_tokens`` more tokens
    (id -> prompt tokens): refused under ``long_prompts=error``, returned to skip under ``skip``."""
    limit, source = context_limit(draft=getattr(draft, "config", None), target=target.config)
    if limit is None:
        return {}
    lengths = {p.id: len(encode_prompt(tokenizer, p.prompt)) for s in todo for p in s.prompts}
    return too_long(lengths, int(cfg.max_new_tokens), limit, source, long_prompts_of(cfg),
                    where=f"data_gen prompts {cfg.prompts.get('path') or cfg.prompts.source!r}")


def _label_shards(cfg: DictConfig, out: Path, existing: dict | None, todo: list[Shard],
                  sampling: SamplingConfig) -> tuple[int, int, float]:
    """Load the pair, write (or check) the meta, then label and save each shard in turn.
    Returns (prompts, target tokens, seconds) of the labelling."""
    draft, target, tokenizer = load_pair(cfg.pair.draft, cfg.pair.target, device=cfg.pair.device,
                                         dtype=cfg.pair.dtype)
    vocab = shared_vocab(draft, target)
    skip = _long_prompts(cfg, todo, draft, target, tokenizer)  # refused (or skipped) before any model runs
    meta = build_meta(cfg, draft, target, vocab)
    if existing is None:
        write_meta(out, meta)
    else:
        check_resumable(str(out), existing, meta)
        if existing.get("code_version") != meta["code_version"]:
            log.warning("resuming %s written by code %s with code %s", out, existing.get("code_version"),
                        meta["code_version"])
    datasets.disable_progress_bars()
    progress = _Progress(sum(len(s.prompts) for s in todo), enabled=cfg.progress)
    for shard in todo:
        rows = label_shard(shard, draft, target, tokenizer, sampling, seed=int(cfg.seed),
                           max_new_tokens=int(cfg.max_new_tokens), batch_size=int(cfg.batch_size),
                           vocab=vocab, progress=progress,
                           cascade=Cascade(**spec) if (spec := cascade_of(cfg)) else None,
                           fast=cfg.get("fast"), skip=frozenset(skip), depths=int(cfg.get("feature_depths", 4)))
        save_shard(out, shard.split, shard.index, rows, prompts=[[p.id, prompt_digest(p)] for p in shard.prompts],
                   skipped={p.id: skip[p.id] for p in shard.prompts if p.id in skip})
    progress.bar.close()
    return progress.prompts, progress.tokens, time.perf_counter() - progress.start


def run(cfg: DictConfig) -> DataGenResult:
    """Generate (or resume, or finish) the labelled dataset described by ``cfg``."""
    _check_settings(cfg)
    if cfg.get("num_threads") is not None:
        torch.set_num_threads(int(cfg.num_threads))
    set_compile_options(cfg.get("compile_options"))
    out = Path(cfg.out)
    sampling = SamplingConfig.from_mapping(cfg.sampling)
    prompts = load_split_prompts(cfg)
    shards, counts = plan_shards(prompts, cfg.shard_size), shard_counts(prompts, cfg.shard_size)
    mine = owned_shards(shards, cfg.shard.index, cfg.shard.count)
    existing = _check_out_dir(out)
    if existing is not None:
        check_resumable(str(out), existing, settings_meta(cfg))
        check_same_prompts(str(out), shards, existing, source_file_digest(cfg.prompts.source, cfg.prompts.get("path")))
    if existing is not None and existing.get("complete"):
        log.info("%s is already complete (%s rows); nothing to do", out, existing.get("rows"))
        return DataGenResult(out, complete=True, rows=existing.get("rows", {}))
    if cfg.consolidate_only:
        if existing is None:
            raise FileNotFoundError(f"consolidate_only=true but out={str(out)!r} holds no data_gen run")
        rows = _consolidate_once(out, counts, existing)
        return DataGenResult(out, complete=rows is not None, rows=rows or {})

    todo = [s for s in mine if not shard_done(out, s.split, s.index)]
    log.info("%s: %d shard(s) to label for process %d/%d", out, len(todo), cfg.shard.index, cfg.shard.count)
    result = DataGenResult(out, complete=False)
    if todo:
        result.n_prompts, result.n_tokens, result.elapsed_s = _label_shards(cfg, out, existing, todo, sampling)
    finished = read_meta(out) or {}
    if finished.get("complete"):  # a parallel worker finished last and consolidated
        result.complete, result.rows = True, finished.get("rows", {})
        return result
    pending = sum(not shard_done(out, s.split, s.index) for s in shards)
    if pending:
        log.info("%d shard(s) of other processes are not finished; the last process to finish "
                 "consolidates (or rerun with consolidate_only=true)", pending)
        return result
    rows = _consolidate_once(out, counts, read_meta(out))
    result.complete, result.rows = rows is not None, rows or {}
    log.info("%s complete: %s rows, %.1f target tok/s", out, result.rows, result.tokens_per_s)
    return result
