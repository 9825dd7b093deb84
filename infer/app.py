"""``run(cfg)``: benchmark one stopping method over a prompt set, one JSONL row per prompt.

Everything that can be wrong with the input (method settings, head, prompts, an incompatible
result file) is checked by :func:`prepare` before any model loads. Loaded pairs are kept for the
next run in the same process, so a Hydra multirun or ``python -m infer.sweep`` loads them once.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import ListConfig, OmegaConf
from tqdm import tqdm

from specdecpp import StopPolicy
from specdecpp.analysis.quality import target_quality
from specdecpp.core.sampling import SamplingConfig
from specdecpp.core.timing import machine_description
from specdecpp.data.prompts import (
    LONG_PROMPTS,
    Prompt,
    context_limit,
    encode_prompt,
    load_prompts,
    prompt_digest,
    too_long,
)
from specdecpp.data.tasks import code_execution_allowed, score_output
from specdecpp.fast.buckets import GRAPH_BACKENDS, check_fast
from specdecpp.fast.compiling import set_compile_options
from specdecpp.models.loading import dtype_name, eos_token_ids, load_pair, resolve_device
from specdecpp.models.reduced_vocab import output_vocab_size

from .methods import CascadeMethod, MethodSpec, build_runner, resolve_method, takes_fast
from .results import (
    ResultWriter,
    check_resumable,
    check_same_prompts,
    pooled_wall,
    prompt_seed,
    read_rows,
)
from .tags import result_path

log = logging.getLogger(__name__)


@dataclass
class Job:
    spec: MethodSpec
    sampling: SamplingConfig
    path: Path
    run_keys: dict  # recorded in every row; must match the rows already in the file
    todo: list[Prompt]
    n_done: int
    pair: dict
    max_new_tokens: int
    warmup_tokens: int
    progress: bool
    profile: bool = False
    batch_size: int = 1
    batch_fill: bool = False
    allow_code_execution: bool = False  # run HumanEval outputs' code to score them (confined; specdecpp.data.tasks)
    fast: str | None = None  # the fast path's backend (None: eager; docs/engine.md "The fast path")
    # graph backends, chain methods: whole rounds captured (True), not (False), or fused
    capture_rounds: bool | str = True
    long_prompts: str = "error"  # a prompt too long for the pair's context: refused (error) or left out (skip)


def fill_pair_from_head(cfg, head_path=None) -> None:
    """``pair.draft`` / ``pair.target`` left unset are taken from an acceptance head's config.json
    (the draft it was trained on, the target of its dataset): ``method.head`` under method=specdecpp
    (or hf_custom with stop=specdecpp), else ``head_path``. Values given on the command line win (a
    draft that differs from the head's is refused later, by the head check)."""
    missing = [k for k in ("draft", "target") if OmegaConf.is_missing(cfg.pair, k)]
    if not missing:
        return
    m = cfg.method
    if m.get("head") and (m.get("name") == "specdecpp" or (m.get("name"), m.get("stop")) == ("hf_custom", "specdecpp")):
        head_path = m.head
    if not head_path:
        raise ValueError(f"pair.{missing[0]} is not set: pass pair=demo, or pair=custom pair.draft=PATH "
                         "pair.target=PATH (with method=specdecpp the pair can come from method.head)")
    from specdecpp import load_head

    head = load_head(str(head_path))
    recorded = {"draft": head.draft, "target": head.meta.get("target")}
    for key in missing:
        if not recorded[key]:
            raise ValueError(f"pair.{key} is not set and head {str(head_path)!r} records no {key} model in its "
                             f"config.json: pass pair.{key}=PATH")
        cfg.pair[key] = str(recorded[key])
    log.info("pair from head %s: draft %s, target %s", head_path, cfg.pair.draft, cfg.pair.target)


def prepare(cfg, spec: MethodSpec | None = None, head_path=None) -> Job:
    """Check the config and find the prompts still to do; loads no model. An unset pair comes from
    the head (see :func:`fill_pair_from_head`)."""
    fill_pair_from_head(cfg, head_path)
    sampling = SamplingConfig.from_mapping(cfg.sampling)
    spec = spec or resolve_method(cfg.method, str(cfg.pair.draft), sampling)
    max_new_tokens, seed = cfg.max_new_tokens, cfg.seed
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    batch_size = cfg.get("batch_size", 1)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if batch_size > 1 and not isinstance(spec.method, (StopPolicy, CascadeMethod)):
        raise ValueError(f"batch_size={batch_size}: method={spec.name} decodes one prompt at a time; batches run "
                         "the engine's stop policies (target_only, fixed_k, svip, specdecpp) and cascades")
    batch_fill = cfg.get("batch_fill", False)
    if not isinstance(batch_fill, bool):
        raise ValueError(f"batch_fill must be true or false, got {batch_fill!r}")
    fast = job_fast(cfg, spec)
    capture_rounds = job_capture_rounds(cfg, spec, fast, batch_size)
    allow_code_execution = cfg.get("allow_code_execution", False)
    code_execution_allowed(allow_code_execution)  # a bad value or a bad SPECDECPP_ALLOW_CODE_EXECUTION fails here
    p = cfg.prompts
    prompts = load_prompts(p.source, split=p.get("split"), limit=p.get("limit"), path=p.get("path"))
    run_keys = {
        "method": spec.name, "settings": spec.settings,
        "pair": {"name": cfg.pair.name, "draft": str(cfg.pair.draft), "target": str(cfg.pair.target)},
        "prompts": {"name": p.name, "source": p.source, "split": p.get("split")},
        "sampling": sampling.to_dict(), "seed": seed, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "fast": fast,
        **({"batch_fill": True} if batch_fill else {}),  # absent when false: older result files resume
        **({"capture_rounds": capture_rounds} if capture_rounds is not True else {}),  # likewise
    }
    path = result_path(cfg.out, spec.tag, sampling, seed, batch_size, batch_fill, fast, capture_rounds)
    long_prompts = cfg.get("long_prompts", "error")
    if long_prompts not in LONG_PROMPTS:
        raise ValueError(f"long_prompts must be one of {', '.join(LONG_PROMPTS)}, got {long_prompts!r}")
    rows = read_rows(path)
    check_resumable(path, rows, run_keys)
    check_same_prompts(path, rows, prompts)
    done = {row["prompt_id"] for row in rows}
    return Job(spec=spec, sampling=sampling, path=path, run_keys=run_keys,
               todo=[q for q in prompts if q.id not in done], n_done=len(done),
               pair={k: cfg.pair.get(k, "auto") for k in ("draft", "target", "device", "dtype")},
               max_new_tokens=max_new_tokens, warmup_tokens=int(cfg.get("warmup_tokens", 0)),
               progress=bool(cfg.get("progress", True)), profile=bool(cfg.get("profile", False)),
               batch_size=batch_size, batch_fill=batch_fill, allow_code_execution=allow_code_execution, fast=fast,
               capture_rounds=capture_rounds, long_prompts=long_prompts)


def job_fast(cfg, spec: MethodSpec) -> str | None:
    """``fast`` for this method: checked (a bad value, ``graphs`` off CUDA and PEARL compiled are
    refused), None for a method that does not decode with our engine's runners (hf_assisted,
    hf_custom, oracle: they ignore it, and their rows say fast: null)."""
    fast = cfg.get("fast")
    if isinstance(fast, ListConfig | list):
        raise ValueError(f"fast={list(fast)}: one run takes one fast path; python -m infer.sweep runs every method "
                         "on each path of a list (make bench-fast)")
    fast = check_fast("infer", fast, resolve_device(cfg.pair.get("device", "auto")) if fast in GRAPH_BACKENDS else None)
    if fast is not None and not takes_fast(spec):
        log.info("method=%s ignores fast=%s (it does not decode with our engine's runners); its rows record fast: null",
                 spec.name, fast)
        return None
    if fast is not None and hasattr(spec.method, "check_fast"):
        spec.method.check_fast(fast)
    return fast


def job_capture_rounds(cfg, spec: MethodSpec, fast: str | None, batch_size: int) -> bool | str:
    """``capture_rounds`` for this run: true (default), false or ``fused`` (a bad value is refused,
    naming it). It acts where a chain method (a stop policy, one prompt at a time) decodes on a graph
    backend (``fused``: ``compile-graphs`` only); elsewhere it is said once and ignored, so that a
    sweep over several paths may set it, and those rows record nothing of it."""
    value = cfg.get("capture_rounds", True)
    if not (value is True or value is False or value == "fused"):
        raise ValueError(f"capture_rounds must be true, false or fused, got {value!r}")
    if value is True:
        return True
    applies = (isinstance(spec.method, StopPolicy) and batch_size == 1
               and fast in (("compile-graphs",) if value == "fused" else GRAPH_BACKENDS))
    if not applies:
        log.info("capture_rounds=%s acts on a stop policy's rounds, one prompt at a time, on fast=%s; "
                 "method=%s with fast=%s and batch_size=%d decodes as without it", value,
                 "compile-graphs" if value == "fused" else "graphs or compile-graphs", spec.name, fast, batch_size)
        return True
    return value


_LOADED: dict[tuple, tuple] = {}


def load_models(pair: dict):
    """``load_pair`` once per process for the same pair (the previous pair is released)."""
    key = tuple(str(pair[k]) for k in ("draft", "target", "device", "dtype"))
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = load_pair(*key)
    return _LOADED[key]


def task_score(job: Job, prompt: Prompt, output_ids: list[int], tokenizer) -> dict:
    """The output's task score (specdecpp.data.tasks, untimed): HumanEval pass@1 by execution (only
    where allowed, confined), GSM8K exact match; ``task`` None for prompts without a task."""
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    return score_output(job.run_keys["prompts"]["source"], prompt.id, prompt.answer, text, job.allow_code_execution)


@functools.cache
def _machine(device: str, threads: int) -> str:  # threads: a key of the cache (the description names them)
    return machine_description(device)


def machine_of(device: torch.device) -> str:
    """``specdecpp.core.timing.machine_description`` (the CPU or GPU, torch, threads), read once per
    device and thread count."""
    return _machine(str(device), torch.get_num_threads())


@dataclass(frozen=True)
class Decoded:
    """One decode to record: its prompt and the prompt's ids, the runner's ``(output_ids, stats,
    extra)``, whether it was timed, and a batched call's keys (``batch_id``, ``batch_wall_time_s``)."""

    prompt: Prompt
    ids: torch.Tensor
    out: tuple
    timed: bool
    batch: dict | None = None


def make_row(job: Job, decoded: Decoded, target, quality: dict | None = None) -> dict:
    """One result row, with the machine it was decoded on (the report names it). ``lossy``: the
    method's output does not follow the target's distribution (a cascade); ``quality``
    (specdecpp.analysis.quality.target_quality and the task score, untimed) is
    recorded for every method, so the exact ones are the reference point of the lossy ones."""
    output_ids, stats, extra = decoded.out
    timed, device, prompt = decoded.timed, target.device, decoded.prompt
    times = {k: getattr(stats, k) if timed else None for k in ("draft_time_s", "target_time_s", "wall_time_s")}
    times = {k: None if v is not None and math.isnan(v) else v for k, v in times.items()}  # not measured
    times["forward_time_s"] = extra.get("forward_time_s") if timed else None
    return {
        **job.run_keys, "tag": job.spec.tag, "prompt_id": prompt.id, "prompt_digest": prompt_digest(prompt),
        "prompt_len": decoded.ids.shape[1],
        "device": str(device), "machine": machine_of(device), "dtype": dtype_name(target.dtype), "timed": timed,
        "n_generated": stats.n_generated, "n_target": stats.n_target_calls, "n_draft": stats.n_draft_calls,
        "n_discarded": stats.n_discarded, "accept_lengths": stats.accept_lengths,
        "candidate_lengths": stats.candidate_lengths, **times,
        "tokens_per_s": stats.tokens_per_s if timed else None,
        "discard_rate": stats.discard_rate, "verification_rate": stats.verification_rate,
        "mean_accept_length": stats.mean_accept_length, "output_ids": output_ids,
        "lossy": bool(getattr(job.spec.method, "lossy", False)), **(quality or {}),
        **(extra.get("row") or {}),  # a method's own counts (PEARL: gamma_used, overlap_time_s, ...)
        **(decoded.batch or {}),
    }


def record(job: Job, writer: ResultWriter, decoded: Decoded, target, tokenizer) -> None:
    """Score one decode untimed and append its row: the one path every row takes."""
    output_ids = decoded.out[0]
    quality = target_quality(target, decoded.ids, output_ids, job.sampling, output_vocab_size(target))
    quality.update(task_score(job, decoded.prompt, output_ids, tokenizer))
    writer.append(make_row(job, decoded, target, quality))


def execute(jobs: list[Job], models) -> list[dict]:
    """Decode every prompt still to do of every job, prompt by prompt: every job's method on a
    prompt before the next prompt, so a drift in machine load touches every method alike (the
    comparison is then paired in time as well as in prompts; one job is simply its prompts in
    order). Rows are appended to each job's own file as they finish (resumable)."""
    draft, target, tokenizer = models
    runners = [build_runner(job.spec, draft, target, job.sampling, profile=job.profile, fast=job.fast,
                            capture_rounds=job.capture_rounds) for job in jobs]
    writers = [ResultWriter(job.path) for job in jobs]
    eos = sorted(eos_token_ids(tokenizer, target))
    order: dict[str, Prompt] = {}
    for job in jobs:
        for q in job.todo:
            order.setdefault(q.id, q)
    encoded = {pid: torch.tensor([encode_prompt(tokenizer, q.prompt)], device=target.device)
               for pid, q in order.items()}
    encoded = skip_long_prompts(jobs, encoded, draft, target)  # refused (or left out) before any model runs
    for job, runner in zip(jobs, runners, strict=True):  # the fast path: one cache size, every bucket compiled
        if job.fast and job.todo:
            seconds = runner.warm_up(max(encoded[q.id].shape[1] for q in job.todo), job.max_new_tokens,
                                     job.batch_size if job.batch_size > 1 else None, progress=job.progress)
            log.info("%s %s: fast=%s warmed up (compiled) in %.1f s, untimed", job.spec.name, job.spec.tag, job.fast,
                     seconds)
    warm = max((job.warmup_tokens for job in jobs), default=0)
    if encoded and warm > 0:  # untimed, unrecorded: one warm-up per runner
        first = next(iter(encoded.values()))
        for job, runner in zip(jobs, runners, strict=True):
            if runner.timed and job.todo:
                runner.generate(first, min(warm, job.max_new_tokens), job.run_keys["seed"], eos)
    if any(job.batch_size > 1 for job in jobs):
        execute_batched(jobs, runners, writers, order, encoded, eos, target, tokenizer)
    else:
        execute_calls(jobs, runners, writers, order, encoded, eos, target, tokenizer)
    return [summarize(job) for job in jobs]


def execute_calls(jobs: list[Job], runners, writers, order: dict, encoded: dict, eos, target, tokenizer) -> None:
    """:func:`execute` one prompt per call: every job's method on a prompt before the next prompt."""
    todo = [{q.id for q in job.todo} for job in jobs]
    total = sum(len(t) for t in todo)
    desc = f"{jobs[0].spec.name} {jobs[0].spec.tag}" if len(jobs) == 1 else f"{len(jobs)} methods, interleaved"
    with tqdm(total=total, desc=desc, disable=not jobs or not jobs[0].progress, unit="run") as bar:
        for pid, ids in encoded.items():
            for job, runner, writer, ids_todo in zip(jobs, runners, writers, todo, strict=True):
                if pid not in ids_todo:
                    continue
                out = runner.generate(ids, job.max_new_tokens, prompt_seed(job.run_keys["seed"], pid), eos)
                record(job, writer, Decoded(order[pid], ids, out, runner.timed), target, tokenizer)
                bar.update(1)


# Prompts per generate_batch call, in units of batch_size: a call runs batch_size rows at once and
# the others wait for a free slot (continuous batching); interleaved jobs alternate call by call.
CALL_SLOTS = 4


def execute_batched(jobs: list[Job], runners, writers, order: dict, encoded: dict, eos, target,
                    tokenizer) -> None:
    """:func:`execute` for ``batch_size`` > 1: each job decodes ``CALL_SLOTS * batch_size`` prompts
    per ``generate_batch`` call, every job a call's prompts before the next call's (paired in time).
    Each row records its batch: ``batch_size``, ``batch_id`` (the call), ``batch_wall_time_s``
    (the call's wall time, which its rows share: throughput = tokens / the calls' time) and
    ``batch_rounds`` (the call's rounds as ``[rows, longest K, draft forwards]``, for the batched Eq. 2.1)."""
    for job, runner in zip(jobs, runners, strict=True):
        if not runner.batched:
            raise ValueError(f"batch_size={job.batch_size}: method={job.spec.name} has no batched runner")
    ids = list(encoded)
    todo = [{q.id for q in job.todo} for job in jobs]
    width = CALL_SLOTS * max(job.batch_size for job in jobs)
    with tqdm(total=sum(len(t) for t in todo), disable=not jobs[0].progress, unit="run",
              desc=f"{len(jobs)} method(s), batches of {[job.batch_size for job in jobs]}") as bar:
        for start in range(0, len(ids), width):
            chunk = ids[start : start + width]
            for job, runner, writer, ids_todo in zip(jobs, runners, writers, todo, strict=True):
                mine = [pid for pid in chunk if pid in ids_todo]
                if not mine:
                    continue
                seeds = [prompt_seed(job.run_keys["seed"], pid) for pid in mine]
                outs, wall = runner.generate_batch([encoded[pid] for pid in mine], job.max_new_tokens, seeds, eos,
                                                   job.batch_size, fill=job.batch_fill)
                batch_id = f"{mine[0]}+{len(mine)}"
                for pid, out in zip(mine, outs, strict=True):
                    record(job, writer, Decoded(order[pid], encoded[pid], out, runner.timed,
                                                {"batch_id": batch_id, "batch_wall_time_s": wall}), target, tokenizer)
                bar.update(len(mine))


def skip_long_prompts(jobs: list[Job], encoded: dict, draft, target) -> dict:
    """Check every job's prompts against the pair's context (:func:`specdecpp.data.prompts.too_long`:
    prompt tokens plus ``max_new_tokens`` within ``max_position_embeddings``, which also caps the fast
    path's static caches): a long one is an error, or under ``long_prompts=skip`` it is dropped from
    the job's prompts (no row) with a warning. Returns ``encoded`` without prompts no job decodes."""
    limit, source = context_limit(draft=getattr(draft, "config", None), target=target.config)
    for job in jobs:
        lengths = {q.id: encoded[q.id].shape[1] for q in job.todo}
        long = too_long(lengths, job.max_new_tokens, limit, source, job.long_prompts,
                        where=f"infer prompts {job.run_keys['prompts']['name']!r}")
        job.todo = [q for q in job.todo if q.id not in long]
    kept = {q.id for job in jobs for q in job.todo}
    return {pid: ids for pid, ids in encoded.items() if pid in kept}


def summarize(job: Job) -> dict:
    rows = read_rows(job.path)
    timed = [r for r in rows if r.get("timed")]
    wall = pooled_wall(timed)
    return {"path": str(job.path), "method": job.spec.name, "tag": job.spec.tag, "rows": len(rows),
            "new_rows": len(rows) - job.n_done,
            "tokens_per_s": sum(r["n_generated"] for r in timed) / wall if wall > 0 else None}


def set_process_options(cfg) -> None:
    """``num_threads``: CPU threads for torch (null: torch's default); ``compile_options``: inductor's
    settings for ``fast=compile`` on a CPU (tuned, plain or a mapping: :func:`set_compile_options`)."""
    n = cfg.get("num_threads")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_threads must be an integer >= 1 or null, got {n!r}")
        torch.set_num_threads(n)
    set_compile_options(cfg.get("compile_options"))


def run(cfg) -> dict:
    """Benchmark ``cfg.method`` on ``cfg.pair`` over ``cfg.prompts``; returns a summary dict."""
    set_process_options(cfg)
    job = prepare(cfg)
    if not job.todo:
        log.info("%s is complete (%d rows); nothing to do", job.path, job.n_done)
        return summarize(job)
    return execute([job], load_models(job.pair))[0]
