"""Experiment 10, end to end (research/loop_cache/README.md): the numba kernels of ``kept_numba.py``
beside this file on and off (``kept_numba.STATE``) in ONE process, so both use the same
compiled steps (one compile, not two as ``scripts/compare_checkouts.py`` would need), prompt by prompt,
alternating which goes first. Compiled (``fast=compile``), sampled (T=1, top-k 50, one seeded generator
per prompt, the same both ways), bundled test prompts; the tokens must be the same both ways, tokens/s
compared as a pooled ratio with a paired bootstrap over prompts.

    SPECDECPP_CACHE=.cache PYTHONPATH=. python research/loop_cache/numba_ab.py --head demo/heads/next_wrej1_d1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from specdecpp import (
    SVIP,
    FixedK,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
    TargetOnly,
    load_head,
    load_pair,
)
from specdecpp.analysis.stats import paired_ratio_interval
from specdecpp.core.timing import machine_description
from specdecpp.data.prompts import encode_prompt, load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kept_numba  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=".cache/demo/draft")
    ap.add_argument("--target", default=".cache/demo/target")
    ap.add_argument("--head", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kept_numba.install()
    draft, target, tok = load_pair(draft=args.draft, target=args.target, dtype="fast")
    prompts = load_prompts("bundled", split="test", limit=args.prompts)
    cfg = SamplingConfig(temperature=1.0, top_k=50)
    decoders = {"target_only": SpeculativeDecoder(draft, target, TargetOnly(), cfg, fast="compile"),
                "fixed_k3": SpeculativeDecoder(draft, target, FixedK(3), cfg, fast="compile"),
                "svip": SpeculativeDecoder(draft, target, SVIP(threshold=0.5), cfg, fast="compile"),
                "specdecpp": SpeculativeDecoder(draft, target, SpecDecPP(load_head(args.head), threshold=0.5), cfg,
                                                fast="compile")}
    encoded = [torch.tensor([encode_prompt(tok, p.prompt)]) for p in prompts]
    longest = max(ids.shape[1] for ids in encoded)
    for d in decoders.values():
        d.warm_up(longest, args.max_new_tokens)
    print(machine_description(torch.device("cpu")))
    print(f"{'method':12} {'same tokens':>12} {'numpy tok/s':>12} {'numba tok/s':>12}  numba/numpy [95% CI]")
    for method, decoder in decoders.items():
        rows = []
        for i, ids in enumerate(encoded):
            row = {}
            for flag in (("1", "0") if i % 2 == 0 else ("0", "1")):
                kept_numba.STATE["on"] = flag == "1"
                out = decoder.generate(ids, args.max_new_tokens, torch.Generator().manual_seed(i),
                                       eos_token_id=tok.eos_token_id)
                row[flag] = (out.tokens[0, ids.shape[1]:].tolist(), out.stats.n_generated, out.stats.wall_time_s)
            rows.append(row)
        same = sum(r["0"][0] == r["1"][0] for r in rows)
        n = {f: np.array([r[f][1] for r in rows], float) for f in "01"}
        s = {f: np.array([r[f][2] for r in rows]) for f in "01"}
        speed = {f: n[f].sum() / s[f].sum() for f in "01"}
        low, high = paired_ratio_interval(n["1"], s["1"], n["0"], s["0"])
        print(f"{method:12} {same:>8}/{len(rows):<3} {speed['0']:>12.2f} {speed['1']:>12.2f}  "
              f"{speed['1'] / speed['0']:.3f} [{low:.3f}, {high:.3f}]", flush=True)


if __name__ == "__main__":
    main()
