"""python -m infer.sweep [overrides]: the paper's whole comparison in one process.

Every entry of ``cfg.comparison`` (method -> settings; a list is a grid) becomes one run with the
same pair, prompts, sampling and seeds. All runs are checked first, then the models are loaded
once and shared. Each run writes its own result file, resumable like ``python -m infer``.
``interleave=true`` runs every method on a prompt before the next prompt (load drift on a shared
machine then touches all methods alike; what `make bench` uses).

``fast`` may be a list here, e.g. ``'fast=[null,compile]'``: every method then runs on each of
those paths (eager and compiled side by side, one result file each; a method that ignores ``fast``
runs once), in one process, interleaved with the others (``make bench-fast``).
"""

from __future__ import annotations

import itertools
import logging

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from .app import execute, load_models, prepare, set_process_options, summarize
from .methods import method_config

log = logging.getLogger(__name__)


def expand_comparison(comparison) -> list[DictConfig]:
    """Method configs of every grid point: conf/method/<name>.yaml merged with the entry. An entry
    that is a list holds several grids of one method, e.g. HF assisted generation at constant
    lengths 1-4 and, beside it, its adaptive modes at one starting length."""
    configs = []
    for name, entries in (comparison or {}).items():
        try:
            base = method_config(name)
        except ValueError as exc:
            raise ValueError(f"comparison.{name}: {exc}") from None
        for entry in (entries if isinstance(entries, ListConfig | list) else [entries]):
            entry = entry or {}
            fixed = {k: v for k, v in entry.items() if not isinstance(v, ListConfig | list)}
            grid = {k: list(v) for k, v in entry.items() if isinstance(v, ListConfig | list)}
            if any(not values for values in grid.values()):
                raise ValueError(f"comparison.{name}: an empty grid {grid}")
            for point in itertools.product(*grid.values()):
                configs.append(OmegaConf.merge(base, fixed, dict(zip(grid, point, strict=True))))
    return configs


def fast_paths(fast) -> list:
    """The fast paths every method runs on: ``fast`` itself, or each entry of a list of them."""
    if not isinstance(fast, ListConfig | list):
        return [fast]
    values = list(fast)
    if not values or len(set(values)) < len(values):
        raise ValueError(f"fast={values}: a list needs distinct fast paths, e.g. fast=[null,compile]")
    return values


def run(cfg) -> list[dict]:
    """Run every method of ``cfg.comparison``; return one summary per run."""
    set_process_options(cfg)
    entries = (cfg.comparison or {}).get("specdecpp") or {}
    heads = [e.get("head") for e in entries] if isinstance(entries, ListConfig | list) else [entries.get("head")]
    heads = [h for hs in heads for h in (hs if isinstance(hs, ListConfig | list) else [hs]) if h]
    # an unset pair comes from the (first) SpecDec++ head of the comparison, for every method
    first_head = heads[0] if heads else None
    jobs, paths = [], set()
    for method in expand_comparison(cfg.comparison):
        if method.name == "oracle" and float(cfg.sampling.temperature) != 0:
            log.warning("comparison.oracle skipped: the oracle needs greedy decoding (sampling=greedy)")
            continue
        for fast in fast_paths(cfg.get("fast")):
            sub = cfg.copy()
            with open_dict(sub):
                sub.method, sub.fast = method, fast
            job = prepare(sub, head_path=first_head)  # every check before any model loads
            if job.path not in paths:  # a method that ignores fast: one run, not one per path
                paths.add(job.path)
                jobs.append(job)
    if cfg.get("interleave") and jobs:
        pending = [job for job in jobs if job.todo]
        by_path = {job.path: s
                   for job, s in zip(pending, execute(pending, load_models(jobs[0].pair)) if pending else [],
                                     strict=True)}
        return [by_path.get(job.path) or summarize(job) for job in jobs]
    summaries = []
    for job in jobs:
        if not job.todo:
            log.info("%s is complete; skipped", job.path)
            summaries.append(summarize(job))
            continue
        summaries.append(execute([job], load_models(job.pair))[0])
    return summaries


@hydra.main(config_path="../conf", config_name="infer", version_base="1.3")
def main(cfg) -> None:
    for s in run(cfg):
        tps = f"{s['tokens_per_s']:.2f}" if s["tokens_per_s"] is not None else "-"
        print(f"{s['method']:>12} {s['tag']:<28} rows {s['rows']:>4}  tokens/s {tps:>8}  {s['path']}")


if __name__ == "__main__":
    main()
