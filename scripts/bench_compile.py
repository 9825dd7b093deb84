"""Inductor settings for the fast path's compiled step, against the weight-read floor (issue 33).

    python scripts/bench_compile.py                                   # demo target, width 1, every variant
    python scripts/bench_compile.py --variants default,freezing --widths 1,2,4,8 --model draft
    python scripts/bench_compile.py --variants freezing --profile     # where a compiled forward's time goes

One process: the demo pair as ``make demo-pair`` materialises it (``--draft``/``--target`` for
another), one model (``--model``), a cached
context of ``--context`` tokens in a static cache of ``--size`` slots. Every variant gets a
:class:`~specdecpp.fast.runners.StaticRunner` of its own, compiled with its inductor settings
(``VARIANTS``: ``freezing``, ``cpp_wrapper``, ``max_autotune`` with the CPP GEMM template,
``coordinate_descent_tuning``, what ``mode="max-autotune-no-cudagraphs"`` sets, and combinations),
besides the eager :class:`~specdecpp.models.runner.ModelRunner` and the uncompiled static runner.
``--with-guards``: each compiled variant is timed a second time with every dynamo guard evaluated
(``error_on_recompile`` set and reset around each call, 3 us; the steps otherwise skip them, specdecpp.fast.compiling,
"Guards"). Printed per variant: the compile time of each width (cold unless inductor's cache already holds
it: give a fresh ``TORCHINDUCTOR_CACHE_DIR`` for cold figures), the growth of the resident memory,
whether a second call recompiled (``error_on_recompile``), the largest logit difference to the
eager runner and whether the argmax agrees.

Timing: every (variant, width) forward and a tensor copy of ``--bandwidth-mb`` MB are interleaved
call by call (``specdecpp.core.timing.time_forwards``), ``--repeats`` timed calls per block,
``--blocks`` blocks; a variant's figure is the median over all its calls, its spread the lowest
and highest block median. The floor is the target's weight bytes (``bench_fast.weight_bytes``)
over the copy bandwidth of the same block (read + written bytes / s). Since the copy's bandwidth drifts
more than the forward (20-28 GB/s in one day on the project's CPU), each forward is also set against
the copy timed next to it in the same round: the median of those paired ratios, with a 95% bootstrap
interval over rounds (``specdecpp.analysis.stats``), is the "x floor, paired" column. ``--profile``: the operators
of ten calls of each variant at the first width (torch.profiler), the linear layers grouped by
weight shape. Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fast import weight_bytes  # noqa: E402

from specdecpp.analysis.stats import bootstrap_interval  # noqa: E402
from specdecpp.core.timing import machine_description, time_forwards  # noqa: E402
from specdecpp.fast.compiling import TUNED_COMPILE_OPTIONS  # noqa: E402
from specdecpp.fast.runners import StaticRunner  # noqa: E402
from specdecpp.fast.step import ModelSteps  # noqa: E402
from specdecpp.models.loading import load_pair  # noqa: E402
from specdecpp.models.runner import ModelRunner  # noqa: E402
from specdecpp_demo.pair import cache_dir  # noqa: E402

DEMO = cache_dir()  # the materialised demo pair ($SPECDECPP_CACHE/demo; make demo-pair)
AUTOTUNE = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
VARIANTS: dict[str, dict | None] = {
    "eager": None,  # ModelRunner over DynamicCache
    "static": None,  # StaticRunner, not compiled
    "default": {},
    "freezing": {"freezing": True},
    "freezing_noprepack": {"freezing": True, "cpp.weight_prepack": False},
    "cpp_wrapper": {"cpp_wrapper": True},
    "coordinate_descent": {"coordinate_descent_tuning": True},
    "max_autotune": AUTOTUNE,
    "mode_max_autotune_no_cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
    "freezing+cpp_wrapper": {"freezing": True, "cpp_wrapper": True},
    "tuned": TUNED_COMPILE_OPTIONS["cpu"],  # the CPU default: freezing+max_autotune, freezing+cpp_gemm up to 4 rows
    # the CPU default with inductor's concat-linear pass: the linears sharing an input (q, k, v; gate, up) as one GEMM
    "tuned+concat_linear": {**TUNED_COMPILE_OPTIONS["cpu"], "cpp.enable_concat_linear": True},
    "freezing+max_autotune": {"freezing": True, **AUTOTUNE},
    "freezing+cpp_gemm": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},
    "freezing+max_autotune+noprepack": {"freezing": True, **AUTOTUNE, "cpp.weight_prepack": False},
    "freezing+max_autotune+cpp_wrapper": {"freezing": True, "cpp_wrapper": True, **AUTOTUNE},
    "freezing+max_autotune+tensor_guards": {"freezing": True, **AUTOTUNE,
                                            "guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe},
    "freezing+max_autotune+no_module_guards": {"freezing": True, **AUTOTUNE,
                                               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def runner_for(variant: str, model, size: int, widths: list[int]):
    vocab = model.config.vocab_size
    if variant == "eager":
        return ModelRunner(model, vocab, False)
    fast = "static" if variant == "static" else "compile"
    runner = StaticRunner(model, vocab, False, fast=fast, max_len=size - max(widths), buckets=tuple(widths),
                          cover=False)  # each width timed in its own bucket
    runner.steps = ModelSteps(warned_wide=True)  # compiled steps of this variant only (the prefill is wide)
    runner.compile_options = dict(VARIANTS[variant] or {})
    return runner


def profile(calls: dict, prime) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = []
    for name, call in calls.items():
        for _ in range(3):
            prime[name](), call()
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(10):
                prime[name](), call()
        out += [f"### {name} (10 calls)", prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50, max_shapes_column_width=60)]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    ap.add_argument("--model", choices=["target", "draft"], default="target")
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--widths", default="1", help="comma-separated forward widths (each its own bucket)")
    ap.add_argument("--context", type=int, default=64, help="cached tokens before a timed forward")
    ap.add_argument("--size", type=int, default=256, help="static cache slots (a call of <= ~200 tokens gets 256)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per forward and block")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--bandwidth-mb", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables instead of timing")
    ap.add_argument("--with-guards", action="store_true",
                    help="also time each compiled variant with every dynamo guard evaluated (the steps skip them)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    widths = sorted({int(w) for w in args.widths.split(",")})
    if args.context + max(widths) >= args.size - max(widths):
        ap.error(f"--context {args.context} + width {max(widths)} does not fit --size {args.size}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    draft, target, _ = load_pair(args.draft, args.target, device="cpu", dtype=args.dtype)
    model = target if args.model == "target" else draft
    vocab = model.config.vocab_size
    context = torch.randint(3, vocab, (args.context + max(widths),), generator=torch.Generator().manual_seed(1))
    head, tail = context[: args.context], context[args.context:]
    print(f"{machine_description()}; {args.model} {args.dtype}; cache size {args.size}; context {args.context}",
          flush=True)

    from torch._dynamo.utils import counters

    calls, resets, info, logits = {}, {}, {}, {}
    counters.clear()  # count only this run's compiles, not those of earlier work in the process
    with torch.no_grad():
        for variant in variants:
            runner = runner_for(variant, model, args.size, widths)
            runner.feed(head)
            length, info[variant] = runner.length, {"compile_s": {}, "rss_mb": 0.0}
            for w in widths:
                rss, t0 = rss_mb(), time.perf_counter()
                first = runner.feed(tail[:w], n_logits=w)[0].float()
                info[variant]["compile_s"][w] = time.perf_counter() - t0
                info[variant]["rss_mb"] += rss_mb() - rss
                runner.rollback(length)
                logits[(variant, w)] = first
                calls[(variant, w)] = lambda r=runner, t=tail[:w], w=w: r.feed(t, n_logits=w)
                resets[(variant, w)] = lambda r=runner, n=length: r.rollback(n)
                if args.with_guards and variant not in ("eager", "static"):
                    def guarded(r=runner, t=tail[:w], w=w):
                        # compiling.compiled_step evaluates every guard under error_on_recompile; set directly (3 us),
                        # not through config.patch (about 0.3 ms a call)
                        torch._dynamo.config.error_on_recompile = True
                        try:
                            return r.feed(t, n_logits=w)
                        finally:
                            torch._dynamo.config.error_on_recompile = False
                    calls[(variant + "/guards", w)], resets[(variant + "/guards", w)] = guarded, resets[(variant, w)]
            cache = {k.removeprefix("fxgraph_cache_"): n for k, n in counters["inductor"].items()
                     if k.startswith("fxgraph_cache_")}
            counters.clear()
            print(f"{variant}: compile " + ", ".join(f"w{w} {s:.1f} s" for w, s in info[variant]["compile_s"].items())
                  + f", resident memory +{info[variant]['rss_mb']:.0f} MB, inductor FX graph cache {cache}", flush=True)
            info[variant]["fx_graph_cache"] = cache
            if args.with_guards and variant not in ("eager", "static"):
                info[variant + "/guards"] = info[variant]
        with torch._dynamo.config.patch(error_on_recompile=True):  # a second call of any step must not compile again
            for key, call in calls.items():
                call(), resets[key]()
        for (variant, w), first in logits.items():
            ref = logits[(variants[0], w)]
            diff = torch.where(first == ref, 0.0, first - ref)  # a reduced-vocabulary draft's -inf logits agree
            info[variant].setdefault("max_abs_diff", {})[w] = diff.abs().max().item()
            info[variant].setdefault("argmax_equal", {})[w] = bool((first.argmax(-1) == ref.argmax(-1)).all())
        if args.profile:
            print(profile({v: calls[(v, widths[0])] for v in variants}, {v: resets[(v, widths[0])] for v in variants}))
            return 0
        src = torch.rand(args.bandwidth_mb * 2**20 // 4)
        dst = torch.empty_like(src)
        calls["copy"] = lambda: dst.copy_(src)
        blocks = [time_forwards(calls, repeats=args.repeats, warmup=2, resets=resets) for _ in range(args.blocks)]
    wbytes = weight_bytes(model)
    def floor_of(copy_s: float) -> float:  # the weights' read time at a copy's bandwidth (read + written bytes)
        return wbytes * copy_s / (2 * src.numel() * 4)

    floors = [floor_of(b["copy"].median) for b in blocks]
    round_floors = [floor_of(t) for b in blocks for t in b["copy"].times]
    floor = statistics.median(floors)
    result = {"machine": machine_description(), "model": args.model, "dtype": args.dtype, "size": args.size,
              "context": args.context, "weight_mb": wbytes / 1e6, "floor_ms": 1e3 * floor,
              "floor_ms_blocks": [1e3 * f for f in floors],
              "floor_ms_rounds": [1e3 * f for f in round_floors], "variants": {}}
    print(f"\nweights {wbytes / 1e6:.0f} MB; copy bandwidth {wbytes / floor / 1e9:.1f} GB/s; "
          f"floor {1e3 * floor:.1f} ms "
          f"(blocks {', '.join(f'{1e3 * f:.1f}' for f in floors)})\n")
    print("| variant | width | median ms | block medians ms | x floor | x floor, paired [95% CI] | compile s | "
          "memory +MB | max |logit diff| vs first | argmax equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant in dict.fromkeys(k[0] for k in calls if isinstance(k, tuple)):
        rows = {}
        for w in widths:
            times = [t for b in blocks for t in b[(variant, w)].times]
            med = statistics.median(times)
            per_block = [b[(variant, w)].median for b in blocks]
            paired = np.asarray(times) / np.asarray(round_floors)  # each forward over the copy timed in its round
            low, high = bootstrap_interval(lambda x, axis=-1: np.median(x, axis=axis), paired)
            rows[w] = {"median_ms": 1e3 * med, "block_medians_ms": [1e3 * m for m in per_block],
                       "times_ms": [1e3 * t for t in times], "over_floor": med / floor,
                       "over_floor_paired": float(np.median(paired)), "over_floor_paired_ci": [low, high]}
            print(f"| {variant} | {w} | {1e3 * med:.1f} | {1e3 * min(per_block):.1f}-{1e3 * max(per_block):.1f} | "
                  f"{med / floor:.2f} | {np.median(paired):.2f} [{low:.2f}, {high:.2f}] | "
                  f"{info[variant]['compile_s'][w]:.0f} | {info[variant]['rss_mb']:.0f} | "
                  f"{info[variant]['max_abs_diff'][w]:.3g} | {info[variant]['argmax_equal'][w]} |")
        result["variants"][variant] = {**info[variant], "widths": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
