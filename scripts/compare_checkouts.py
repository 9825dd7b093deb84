"""Before/after in one run: do two checkouts of this project decode the same tokens, as fast?

Each checkout runs in its own worker process (imported from that checkout's directory, through the
public API only: load_pair, SpeculativeDecoder, TargetOnly, FixedK, SVIP, SpecDecPP, load_head), both load the
same pair, and the prompts alternate between them (old-new, new-old, ...) so that machine load hits
both alike. Greedy decoding by default; ``--sampling paper`` samples (temperature 1, top-k 50) with
one seeded generator per prompt, the same in both checkouts; ``--fast`` decodes on that fast path in
both (each worker compiles first). Either way the tokens must be
identical (an engine change that keeps the output for the same generator state keeps the sampled
tokens too); tokens/s is compared as the pooled ratio new/old with a paired bootstrap interval over
prompts (specdecpp.analysis.stats).

    python scripts/compare_checkouts.py /path/to/old-checkout . \\
        --draft .cache/demo/draft --target .cache/demo/target --head demo/heads/wrej6_d3 --prompts 10

Exit status 1 when any method's greedy tokens differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

WORKER = r'''
import json, sys
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
try:  # the layout since issue 32; before it, specdecpp.prompts
    from specdecpp.data.prompts import encode_prompt, load_prompts
except ImportError:
    from specdecpp.prompts import encode_prompt, load_prompts

draft_dir, target_dir, head_dir, dtype, n_prompts, tokens, sampling, fast = sys.argv[1:9]
fast = None if fast == "none" else fast
torch.set_num_threads(1)
draft, target, tok = load_pair(draft=draft_dir, target=target_dir, dtype=dtype)
prompts = load_prompts("bundled", split="test", limit=int(n_prompts))
cfg = SamplingConfig(temperature=0) if sampling == "greedy" else SamplingConfig(temperature=1.0, top_k=50)
decoders = {"target_only": SpeculativeDecoder(draft, target, TargetOnly(), cfg, fast=fast),
            "fixed_k1": SpeculativeDecoder(draft, target, FixedK(1), cfg, fast=fast),
            "fixed_k2": SpeculativeDecoder(draft, target, FixedK(2), cfg, fast=fast),
            "svip": SpeculativeDecoder(draft, target, SVIP(threshold=0.5), cfg, fast=fast),
            "specdecpp": SpeculativeDecoder(draft, target, SpecDecPP(load_head(head_dir), threshold=0.5), cfg,
                                            fast=fast)}
if fast is not None:  # compile (or capture) every bucket before the first timed call
    longest = max(len(encode_prompt(tok, p.prompt)) for p in prompts)
    for d in decoders.values():
        d.warm_up(longest, int(tokens))
print(json.dumps({"ready": True, "methods": list(decoders)}), flush=True)
for line in sys.stdin:
    method, i = line.split()
    ids = torch.tensor([encode_prompt(tok, prompts[int(i)].prompt)])
    out = decoders[method].generate(ids, max_new_tokens=int(tokens), eos_token_id=tok.eos_token_id,
                                    generator=torch.Generator().manual_seed(int(i)))
    print(json.dumps({"tokens": out.tokens[0, ids.shape[1]:].tolist(), "n": out.stats.n_generated,
                      "wall_s": out.stats.wall_time_s}), flush=True)
'''


class Worker:
    def __init__(self, checkout: Path, args, env: list[str] = ()) -> None:
        extra = dict(kv.split("=", 1) for kv in env)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(Path(args.draft).resolve()), str(Path(args.target).resolve()),
             str(Path(args.head).resolve()), args.dtype, str(args.prompts), str(args.max_new_tokens), args.sampling,
             args.fast or "none"],
            cwd=checkout, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **extra})
        first = self.proc.stdout.readline()
        if not first:
            raise SystemExit(f"the worker in {checkout} exited before it was ready (its error is above)")
        self.methods = json.loads(first)["methods"]

    def ask(self, method: str, i: int) -> dict:
        self.proc.stdin.write(f"{method} {i}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the old checkout (a directory with specdecpp/)")
    parser.add_argument("new", type=Path, help="the new checkout")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--head", required=True, help="a head directory both checkouts can load")
    parser.add_argument("--dtype", default="fast")
    parser.add_argument("--prompts", type=int, default=10, help="bundled test prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sampling", choices=("greedy", "paper"), default="greedy",
                        help="paper: temperature 1, top-k 50, a seeded generator per prompt")
    parser.add_argument("--fast", choices=("static", "compile", "graphs", "compile-graphs"),
                        help="decode on this fast path in both checkouts (default eager); each worker compiles its "
                        "buckets before the first timed call")
    parser.add_argument("--env-old", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the old checkout's worker only (repeatable), e.g. "
                        "SPECDECPP_TORCH_INTERNALS=-direct_call with the same checkout twice")
    parser.add_argument("--env-new", action="append", default=[], metavar="KEY=VALUE",
                        help="the same for the new checkout's worker")
    args = parser.parse_args(argv)
    for kv in args.env_old + args.env_new:
        if "=" not in kv:
            parser.error(f"--env-old/--env-new {kv!r}: give KEY=VALUE")
    for name in ("old", "new"):
        if not (getattr(args, name) / "specdecpp" / "__init__.py").is_file():
            parser.error(f"{name} {str(getattr(args, name))!r} is not a checkout of this project (no specdecpp/)")
    from specdecpp.analysis.stats import paired_ratio_interval

    workers = {"old": Worker(args.old, args, args.env_old), "new": Worker(args.new, args, args.env_new)}
    failed = False
    print(f"{'method':10} {'same tokens':>12} {'old tok/s':>10} {'new tok/s':>10}  new/old [95% CI]")
    for method in workers["new"].methods:
        rows = []
        for i in range(args.prompts):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            rows.append({name: workers[name].ask(method, i) for name in order})
        same = sum(r["old"]["tokens"] == r["new"]["tokens"] for r in rows)
        failed |= same < len(rows)
        n = {k: np.array([r[k]["n"] for r in rows], float) for k in ("old", "new")}
        s = {k: np.array([r[k]["wall_s"] for r in rows]) for k in ("old", "new")}
        speed = {k: n[k].sum() / s[k].sum() for k in n}
        low, high = paired_ratio_interval(n["new"], s["new"], n["old"], s["old"])
        print(f"{method:10} {same:>8}/{len(rows):<3} {speed['old']:>10.1f} {speed['new']:>10.1f}  "
              f"{speed['new'] / speed['old']:.3f} [{low:.3f}, {high:.3f}]")
    for w in workers.values():
        w.proc.stdin.close()
        w.proc.wait()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
