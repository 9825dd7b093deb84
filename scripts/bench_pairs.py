"""Two drafts of one target in one interleaved run: tokens/s of each (pair, method) on held-out prompts,
with paired 95% intervals against target-only (docs/results/feature_draft.md).

    python scripts/bench_pairs.py --pairs demo demo_feature --prompts 8 --max-new-tokens 64 \
        --methods target_only fixed_k1 fixed_k2 fixed_k3 svip0.5 --out reports/pairs/bench.json

Every (pair, method) decodes a prompt before the next prompt is decoded (so machine load falls on all
alike), each with the prompt's own generator (T = 1, top-k 50: the paper's sampling); target-only runs
once, on the first pair's target (the pairs share it). Held out: the bundled test split and HumanEval.
Pooled tokens / seconds per (pair, method) and source, and its ratio to target-only with a paired
bootstrap interval over prompts (specdecpp.analysis.stats).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from specdecpp import SVIP, FixedK, SamplingConfig, SpecDecPP, SpeculativeDecoder, TargetOnly, load_head, load_pair
from specdecpp.analysis.stats import paired_ratio_interval, pooled_ratio
from specdecpp.core.timing import machine_description
from specdecpp.data.labels import prompt_generator
from specdecpp.data.prompts import encode_prompt, load_prompts
from specdecpp.fast import set_compile_options

REPO = Path(__file__).resolve().parents[1]
SAMPLING = SamplingConfig(temperature=1.0, top_k=50, top_p=1.0)


def policy(name: str):
    if name == "target_only":
        return TargetOnly()
    if name.startswith("fixed_k"):
        return FixedK(int(name[len("fixed_k"):]))
    if name.startswith("svip"):
        return SVIP(float(name[len("svip"):]), max_candidates=6)
    raise ValueError(f"unknown method {name!r}: target_only, fixed_kK or svipH (e.g. fixed_k2, svip0.5)")


def head_spec(spec: str) -> tuple[str, str, float]:
    """``PAIR:DIR@THRESHOLD`` -> (pair, head directory, threshold)."""
    pair, sep, rest = spec.partition(":")
    head, at, threshold = rest.rpartition("@")
    if not sep or not at or not pair or not head:
        raise ValueError(f"--head {spec!r}: give PAIR:DIR@THRESHOLD, e.g. demo_feature:heads/demo_feature/x@0.4")
    return pair, head, float(threshold)


def pair_paths(name: str) -> tuple[str, str, str]:
    cfg = OmegaConf.load(REPO / "conf" / "pair" / f"{name}.yaml")
    return str(cfg.draft), str(cfg.target), str(cfg.get("dtype", "auto"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=["demo", "demo_feature"])
    parser.add_argument("--methods", nargs="+", default=["target_only", "fixed_k1", "fixed_k2", "fixed_k3"])
    parser.add_argument("--head", action="append", default=[], metavar="PAIR:DIR@THRESHOLD",
                        help="a trained head's SpecDecPP(head, threshold, max_candidates=6) on that pair (repeatable)")
    parser.add_argument("--sources", nargs="+", default=["bundled", "humaneval"])
    parser.add_argument("--prompts", type=int, default=8, help="per source (test split)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fast", choices=["none", "static", "compile"], default="none",
                        help="the backend of every decoder (a feature draft keeps its eager runner; each decoder is "
                             "warmed up, its buckets compiled, before anything is timed)")
    parser.add_argument("--compile-options", choices=["tuned", "plain"], default="tuned")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    for m in args.methods:
        policy(m)  # a bad name fails before any model loads
    heads = [head_spec(h) for h in args.head]
    for pair, head, _ in heads:
        if pair not in args.pairs:
            raise ValueError(f"--head {pair}:{head}: pair {pair!r} is not in --pairs {args.pairs}")
        if not Path(head).is_dir():
            raise ValueError(f"--head {pair}:{head}: no head directory there")
    torch.set_num_threads(args.threads)
    fast = None if args.fast == "none" else args.fast
    set_compile_options(args.compile_options)
    models = {}
    for name in args.pairs:
        draft, target, dtype = pair_paths(name)
        models[name] = load_pair(draft, target, device="cpu", dtype=dtype)
    tokenizer = models[args.pairs[0]][2]
    runs = [("-", "target_only")] * ("target_only" in args.methods) + [
        (p, m) for p in args.pairs for m in args.methods if m != "target_only"] + [
        (p, f"head:{Path(h).name}@{t:g}") for p, h, t in heads]
    head_policies = {(p, f"head:{Path(h).name}@{t:g}"): (h, t) for p, h, t in heads}
    decoders = {}
    for p, m in runs:
        draft, target, _ = models[args.pairs[0] if p == "-" else p]
        if (p, m) in head_policies:
            h, t = head_policies[(p, m)]
            stop = SpecDecPP(load_head(h), t, max_candidates=6)  # fitted to the draft when the decoder binds it
        else:
            stop = policy(m)
        decoders[(p, m)] = SpeculativeDecoder(draft, target, stop, SAMPLING, fast=fast)
    longest = max(len(encode_prompt(tokenizer, q.prompt)) for source in args.sources
                  for q in load_prompts(source, "test", limit=args.prompts))
    warm = {f"{p}/{m}": round(dec.warm_up(longest, args.max_new_tokens, progress=True), 1)
            for (p, m), dec in decoders.items()}
    print(f"warm-up seconds: {warm}", flush=True)
    rows = []
    for source in args.sources:
        for prompt in load_prompts(source, "test", limit=args.prompts):
            ids = torch.tensor([encode_prompt(tokenizer, prompt.prompt)])
            for (p, m), dec in decoders.items():
                gen = prompt_generator(0, prompt.id)
                start = time.perf_counter()
                out = dec.generate(ids, max_new_tokens=args.max_new_tokens, generator=gen,
                                   eos_token_id=tokenizer.eos_token_id)
                seconds = time.perf_counter() - start
                accepted, drafted = sum(out.stats.accept_lengths), sum(out.stats.candidate_lengths)
                rows.append({"source": source, "prompt": prompt.id, "pair": p, "method": m,
                             "tokens": out.stats.n_generated, "seconds": seconds,
                             "accepted": accepted, "drafted": drafted})
            print(f"{source}/{prompt.id} done", flush=True)
    summary = []
    for source in args.sources:
        base = [r for r in rows if r["source"] == source and r["method"] == "target_only"]
        for p, m in runs:
            mine = [r for r in rows if r["source"] == source and (r["pair"], r["method"]) == (p, m)]
            tok, sec = np.array([r["tokens"] for r in mine], float), np.array([r["seconds"] for r in mine])
            entry = {"source": source, "pair": p, "method": m, "tokens_per_s": float(pooled_ratio(tok, sec)),
                     "acceptance": (sum(r["accepted"] for r in mine) / max(1, sum(r["drafted"] for r in mine)))}
            if base:
                bt, bs = np.array([r["tokens"] for r in base], float), np.array([r["seconds"] for r in base])
                entry["vs_target_only"] = float(pooled_ratio(tok, sec) / pooled_ratio(bt, bs))
                entry["ci95"] = paired_ratio_interval(tok, sec, bt, bs)
            summary.append(entry)
    machine = machine_description("cpu")
    lines = [f"Machine: {machine}. {args.prompts} prompts per source x {args.max_new_tokens} tokens, T=1 top-k 50, "
             f"interleaved per prompt, fast={fast!r}"
             + (f" ({args.compile_options} compile options)." if fast == "compile" else "."), "",
             "| source | pair | method | tok/s | vs target-only [95% CI] | "
             "accepted / drafted |", "|---|---|---|---|---|---|"]
    for e in summary:
        ci = f"{e['vs_target_only']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]" if "ci95" in e else "-"
        lines.append(f"| {e['source']} | {e['pair']} | {e['method']} | {e['tokens_per_s']:.2f} | {ci} | "
                     f"{e['acceptance']:.3f} |")
    table = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "args": {k: str(v) for k, v in vars(args).items()},
                                    "rows": rows, "summary": summary}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
