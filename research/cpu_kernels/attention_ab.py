"""Experiment 1b of README.md: the demo target's static step on a CPU with ``cpu_attention`` (the
engine's, new) against transformers' sdpa (old), one process, interleaved, the same weights in two
model objects, 1 and 4 tokens; the weight-read floor measured as scripts/bench_fast.py does, the
ratio old / new per interleaved round with a 95% bootstrap interval of its median.

    PYTHONPATH=. SPECDECPP_CACHE=.cache python research/cpu_kernels/attention_ab.py \\
        --fast compile --context 64 --max-len 256
"""

import argparse
import contextlib
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import bootstrap

import specdecpp.fast.runners as static
from specdecpp.core.timing import machine_description, time_forwards
from specdecpp.models.loading import load_pair
from specdecpp.models.reduced_vocab import output_vocab_size
from specdecpp_demo import demo_draft_path, demo_target_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_fast import bandwidth, weight_bytes  # noqa: E402


def ratio_ci(old: tuple, new: tuple) -> list[float]:
    r = np.array(old) / np.array(new)
    ci = bootstrap((r,), np.median, confidence_level=0.95, method="percentile", random_state=0).confidence_interval
    return [float(np.median(r)), float(ci.low), float(ci.high)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast", default="compile", choices=("static", "compile"))
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, target, _ = load_pair(str(demo_draft_path()), str(demo_target_path()), device="cpu", dtype="bfloat16")
    old = copy.deepcopy(target)
    chosen = static.static_attention  # the old model object keeps sdpa: no swap around its forwards
    static.static_attention = (lambda config, device: contextlib.nullcontext() if config is old.config
                               else chosen(config, device))
    ctx = torch.randint(3, 40000, (args.context + 10,), generator=torch.Generator().manual_seed(0))
    calls, resets, outs = {}, {}, {}
    with torch.no_grad():
        for name, model in (("cpu_attention", target), ("sdpa", old)):
            runner = static.StaticRunner(model, output_vocab_size(model), False, fast=args.fast, max_len=args.max_len,
                                         buckets=(1, 2, 4, 8))
            runner.feed(ctx[: args.context])
            length = runner.length
            for n in (1, 4):
                t0 = time.time()
                outs[(name, n)] = runner.feed(ctx[args.context: args.context + n], n_logits=n)[0].float()
                runner.rollback(length)
                print(f"{name} {n} tokens: first call {time.time() - t0:.1f} s", flush=True)
                calls[(name, n)] = lambda r=runner, n=n: r.feed(ctx[args.context: args.context + n], n_logits=n)
                resets[(name, n)] = lambda r=runner, length=length: r.rollback(length)
        timed = time_forwards(calls, repeats=args.repeats, warmup=3, resets=resets)
    bw = bandwidth(torch.device("cpu"), 256, 10)
    floor = weight_bytes(target) / bw
    print(json.dumps({
        "machine": machine_description("cpu"), **vars(args), "bandwidth_gb_s": bw / 1e9, "floor_ms": 1e3 * floor,
        "ms": {f"{name} w{n}": 1e3 * t.median for (name, n), t in timed.items()},
        "over_floor": {f"{name} w1": t.median / floor for (name, n), t in timed.items() if n == 1},
        "sdpa_over_cpu_attention": {n: ratio_ci(timed[("sdpa", n)].times, timed[("cpu_attention", n)].times)
                                    for n in (1, 4)},
        "max_logit_diff": {n: (outs[("cpu_attention", n)] - outs[("sdpa", n)]).abs().max().item() for n in (1, 4)},
        "same_argmax": {n: bool(torch.equal(outs[("cpu_attention", n)].argmax(-1), outs[("sdpa", n)].argmax(-1)))
                        for n in (1, 4)}}, indent=1))


if __name__ == "__main__":
    main()
