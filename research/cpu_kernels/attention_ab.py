"""Experiment 1b of README.md: the demo target's static step on a CPU with cpu_attention (new) against sdpa (old), one
   process, interleaved, the same weights in two model objects; the weight-read floor measured as bench_fast does.

    PYTHONPATH=. SPECDECPP_CACHE=.cache python research/cpu_kernels/attention_ab.py compile 64 256 30   # mode, context, max_len, repeats
"""
import sys, time, torch, copy, contextlib, json
sys.path.insert(0, "/work/main")
import specdecpp.models.static as static
from specdecpp.models.static import StaticRunner
from specdecpp.models.loading import load_pair
from specdecpp.core.timing import time_forwards, machine_description
from specdecpp.models.reduced_vocab import output_vocab_size
from specdecpp_demo import demo_draft_path, demo_target_path
sys.path.insert(0, "/work/main/scripts")
from bench_fast import bandwidth, weight_bytes
torch.set_num_threads(1)
mode, ctx_len, max_len, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
_, target, _ = load_pair(str(demo_draft_path()), str(demo_target_path()), device="cpu", dtype="bfloat16")
old = copy.deepcopy(target)
orig = static.static_attention
static.static_attention = lambda config, device: contextlib.nullcontext() if config is old.config else orig(config, device)
ctx = torch.randint(3, 40000, (ctx_len + 10,), generator=torch.Generator().manual_seed(0))
calls, resets, outs = {}, {}, {}
with torch.no_grad():
    for name, m in (("cpu-attention", target), ("sdpa", old)):
        r = StaticRunner(m, output_vocab_size(m), False, fast=mode, max_len=max_len, buckets=(1, 2, 4, 8))
        r.feed(ctx[:ctx_len]); L = r.length
        for n in (1, 4):
            t0 = time.time(); outs[(name, n)] = r.feed(ctx[ctx_len:ctx_len + n], n_logits=n)[0].float(); r.rollback(L)
            print(name, n, "first call", round(time.time() - t0, 1), "s", flush=True)
            calls[(name, n)] = (lambda r=r, n=n: r.feed(ctx[ctx_len:ctx_len + n], n_logits=n))
            resets[(name, n)] = (lambda r=r, L=L: r.rollback(L))
    timed = time_forwards(calls, repeats=repeats, warmup=3, resets=resets)
import numpy as np
from scipy.stats import bootstrap
def ci(old_t, new_t):
    r = np.array(old_t) / np.array(new_t)
    b = bootstrap((r,), np.median, confidence_level=0.95, method="percentile", random_state=0)
    return [float(np.median(r)), float(b.confidence_interval.low), float(b.confidence_interval.high)]
bw = bandwidth(torch.device("cpu"), 256, 10)
floor = weight_bytes(target) / bw
res = {"machine": machine_description("cpu"), "mode": mode, "context": ctx_len, "max_len": max_len,
       "bandwidth_gb_s": bw / 1e9, "floor_ms": 1e3 * floor,
       "ms": {f"{k[0]} w{k[1]}": 1e3 * t.median for k, t in timed.items()},
       "ratio_sdpa_over_new_ci95": {n: ci(timed[("sdpa", n)].times, timed[("cpu-attention", n)].times) for n in (1, 4)},
       "max_logit_diff": {n: (outs[("cpu-attention", n)] - outs[("sdpa", n)]).abs().max().item() for n in (1, 4)},
       "same_argmax": {n: bool(torch.equal(outs[("cpu-attention", n)].argmax(-1), outs[("sdpa", n)].argmax(-1))) for n in (1, 4)}}
print(json.dumps(res, indent=1))
