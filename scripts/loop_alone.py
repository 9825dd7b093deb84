"""The decoding loop alone: what a round costs outside its forwards, with warm caches and with caches
a forward has just flushed (docs/engine.md, "The loop on a CPU: cold caches").

    python scripts/loop_alone.py                                   # the demo pair, sampled, 4 prompts
    python scripts/loop_alone.py --head demo/heads/next_wrej1_d1 --methods fixed_k3 svip head
    python scripts/loop_alone.py --random --prompts 2 --max-new-tokens 16   # the demo configs, random weights

Each (method, prompt) is decoded once for real on the static runner (``fast="static"``, eager
forwards), and every forward step's outputs are recorded. Then the same call is replayed
``--repeats`` times with the same seed, each step handing back its recorded outputs instead of
running the model: what is left is the loop (the runners' feeds around their steps, sampling, the
acceptance rule, the policy, the commit). The replay must produce the recorded tokens (checked).

Two replays per call:

- **warm**: nothing between the steps; the loop's code and data stay in the CPU's caches.
- **cold**: before handing back each step's outputs, ``--flush-mb`` MB are read (a numpy sum, no
  torch op), as a forward streams its weights through the caches, then the outputs themselves are
  read back (a forward leaves its logits in cache). The flush's own time is left out. With about
  the target's weight bytes (the default 256 MB for the demo target's 269 MB), the cold loop is
  what ``scripts/bench_fast.py --breakdown`` measures outside the forwards of a compiled decode
  (research/loop_cache/README.md).

Per method: the loop's ms per round warm and cold (medians over repeats, pooled over prompts), and
cold over warm; the gap between the two is cache refill, not the loop's instructions. ``--metered``
replays with bench_fast's breakdown meters installed (what its timers add). With
``--cold-ops``, also the cost of single small torch and numpy operations warm and right after a
flush. One thread (``--threads``); CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fast import SAMPLINGS, load, methods, prompts  # noqa: E402

from infer.meters import FeedMeters  # noqa: E402
from specdecpp.core.timing import Clock, machine_description  # noqa: E402
from specdecpp.decoders.chain import SpeculativeDecoder  # noqa: E402
from specdecpp.fast import runners  # noqa: E402
from specdecpp.models.loading import dtype_name, eos_token_ids  # noqa: E402


class StepTape:
    """Replaces ``specdecpp.fast.runners.static_step`` (the static runner's eager step): records
    each step's outputs, or hands them back in order with an optional cache flush before each."""

    def __init__(self, flush_mb: int) -> None:
        self.real = runners.static_step
        self.outputs: list[tuple] = []
        self.mode, self.pos, self.flush_s = "record", 0, 0.0
        self.flush = np.ones(max(flush_mb, 1) * 2**18, np.float32)
        self.cold = False

    def __call__(self, *args, **kwargs):
        if self.mode == "record":
            out = self.real(*args, **kwargs)
            self.outputs.append(tuple(None if t is None else t.clone() for t in out))
            return out
        if self.pos >= len(self.outputs):
            raise RuntimeError("loop_alone: the replay ran more forward steps than the recorded call")
        out = self.outputs[self.pos]
        self.pos += 1
        if self.cold:
            t0 = time.perf_counter()
            self.flush.sum()
            for t in out:  # the logits and hidden state back in cache, as a forward leaves them
                if t is not None:
                    t.view(torch.uint8).numpy().sum()
            self.flush_s += time.perf_counter() - t0
        return out

    def start(self, mode: str, cold: bool = False) -> None:
        self.mode, self.cold, self.pos, self.flush_s = mode, cold, 0, 0.0
        if mode == "record":
            self.outputs = []


def replay_call(decoder, tape: StepTape, prompt, args, eos, seed: int) -> dict:
    """One (method, prompt): the recorded call, then ``args.repeats`` warm and cold replays
    alternating; the loop's seconds per replay (flush left out) and the rounds."""
    tape.start("record")
    ref = decoder.generate(prompt, args.max_new_tokens, torch.Generator().manual_seed(seed), eos_token_id=eos)
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    for _ in range(args.repeats):
        for kind in ("warm", "cold"):
            tape.start("replay", cold=kind == "cold")
            t0 = time.perf_counter()
            out = decoder.generate(prompt, args.max_new_tokens, torch.Generator().manual_seed(seed), eos_token_id=eos)
            times[kind].append(time.perf_counter() - t0 - tape.flush_s)
            if tape.pos != len(tape.outputs) or not torch.equal(out.tokens, ref.tokens):
                raise RuntimeError("loop_alone: a replay did not retrace the recorded call (different steps or tokens)")
    return {"rounds": len(ref.stats.accept_lengths), **{k: float(np.median(v)) for k, v in times.items()}}


def median_us(fn, flush: np.ndarray, repeats: int, cold: bool) -> float:
    """The median of ``repeats`` calls of ``fn`` in microseconds, each right after reading ``flush``
    where ``cold`` (the read not timed)."""
    ts = []
    for _ in range(repeats):
        if cold:
            flush.sum()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(ts))


def cold_ops(flush_mb: int, repeats: int = 30) -> list[dict]:
    """Single small operations, warm and right after a flush of ``flush_mb`` MB (medians, us)."""
    flush = np.ones(flush_mb * 2**18, np.float32)
    x, row = torch.randn(50), torch.randn(49152).to(torch.bfloat16)
    xn = x.numpy()
    ops = {"torch: x + 1 (50 floats)": lambda: x + 1,
           "torch: rand(1, float64)": lambda: torch.rand(1, dtype=torch.float64),
           "torch: softmax (50 floats)": lambda: x.softmax(-1), "torch: arange(5)": lambda: torch.arange(5),
           "torch: no_grad() enter": lambda: torch.no_grad().__enter__(),
           "torch: a 49,152 bf16 row to float32": lambda: row.float(),
           "numpy: x + 1 (50 floats)": lambda: xn + 1, "numpy: partition (50 floats)": lambda: np.partition(xn, 10),
           "python: sum(range(100))": lambda: sum(range(100))}
    return [{"op": name, "warm_us": median_us(fn, flush, repeats, False),
             "cold_us": median_us(fn, flush, repeats, True)}
            for name, fn in ops.items()]


def table(result: dict) -> str:
    lines = [f"## The loop alone ({result['machine']}; {result['dtype']}; {result['sampling']}; {result['prompts']} "
             f"prompts x {result['max_new_tokens']} tokens; flush {result['flush_mb']} MB"
             f"{'; metered' if result['metered'] else ''})", "",
             "| method | rounds | warm ms/round | cold ms/round | cold / warm |", "|---|---|---|---|---|"]
    for name, r in result["methods"].items():
        lines.append(f"| {name} | {r['rounds']} | {r['warm_ms_per_round']:.3f} | {r['cold_ms_per_round']:.3f} | "
                     f"{r['cold_over_warm']:.2f}x |")
    if result.get("cold_ops"):
        lines += ["", "| operation | warm us | after a flush us |", "|---|---|---|"]
        lines += [f"| {o['op']} | {o['warm_us']:.1f} | {o['cold_us']:.1f} |" for o in result["cold_ops"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", help="draft model (default: the demo pair's)")
    ap.add_argument("--target", help="target model (default: the demo pair's)")
    ap.add_argument("--random", action="store_true", help="the demo pair's configs with random weights")
    ap.add_argument("--configs", help="a folder with draft.json and target.json (Llama configs), random weights")
    ap.add_argument("--dtype", default="fast", help="fast (bf16 on CPUs with native bf16) | auto | float32 | bfloat16")
    ap.add_argument("--head", help="also SpecDec++ with this head directory (method 'head')")
    ap.add_argument("--head-threshold", type=float, default=0.5)
    ap.add_argument("--head-max", type=int, default=8)
    ap.add_argument("--svip-threshold", type=float, default=0.3)
    ap.add_argument("--svip-max", type=int, default=8)
    ap.add_argument("--methods", nargs="+", help="a subset of target_only fixed_k1 fixed_k2 fixed_k3 svip head "
                    "(default: all there are)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompts' length (random weights)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sampling", choices=sorted(SAMPLINGS), default="paper", help="paper (default: temperature 1, "
                    "top-k 50) or greedy")
    ap.add_argument("--repeats", type=int, default=5, help="warm and cold replays per call (medians)")
    ap.add_argument("--flush-mb", type=int, default=256, help="MB read before each replayed step's outputs (a "
                    "forward streams its weights: the demo target reads 269 MB in bf16; default 256)")
    ap.add_argument("--metered", action="store_true", help="replay with bench_fast's breakdown meters installed "
                    "(infer.meters.FeedMeters): what its timers cost the loop")
    ap.add_argument("--cold-ops", action="store_true", help="also time single small operations warm and cold")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.prompts < 1 or args.flush_mb < 1:
        ap.error("--repeats, --prompts and --flush-mb must be positive")
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    args.device = "cpu"
    draft, target, tokenizer, pair = load(args, device)
    eos = eos_token_ids(tokenizer, draft, target) if tokenizer is not None else None
    ids = prompts(args, tokenizer, target.config.vocab_size, device)
    available = methods(args, draft)
    names = args.methods or list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose from {list(available)} (head needs --head)")
    tape = StepTape(args.flush_mb)
    runners.static_step = tape
    try:
        result = {"machine": machine_description(device), "pair": pair, "dtype": dtype_name(target.dtype),
                  "sampling": args.sampling, "prompts": len(ids), "max_new_tokens": args.max_new_tokens,
                  "flush_mb": args.flush_mb, "repeats": args.repeats, "metered": args.metered, "methods": {}}
        for name in names:
            decoder = SpeculativeDecoder(draft, target, methods(args, draft)[name], SAMPLINGS[args.sampling],
                                         fast="static")
            if args.metered:
                decoder.runners = FeedMeters(decoder.runners, {id(draft): "draft", id(target): "target"}, Clock(device))
            calls = [replay_call(decoder, tape, p, args, eos, args.seed + i) for i, p in enumerate(ids)]
            rounds = sum(c["rounds"] for c in calls)
            warm, cold = (1e3 * sum(c[k] for c in calls) / rounds for k in ("warm", "cold"))
            result["methods"][name] = {"rounds": rounds, "warm_ms_per_round": warm, "cold_ms_per_round": cold,
                                       "cold_over_warm": cold / warm, "calls": calls}
            print(f"{name}: {warm:.3f} ms/round warm, {cold:.3f} cold ({rounds} rounds)", flush=True)
    finally:
        runners.static_step = tape.real
    if args.cold_ops:
        result["cold_ops"] = cold_ops(args.flush_mb)
    print(table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
