"""Where a compiled bucket's compile time goes (issue 33: compile time on a CPU).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) SPECDECPP_CACHE=.cache PYTHONPATH=. \
        python research/compile_time/probe.py --widths 1 --options tuned [--profile out.prof]
    SPECDECPP_TORCH_INTERNALS=none ...    # the same without the codegen_memo piece (specdecpp.fast.torch_internals)

Compiles the demo target's (or draft's) one bucket per width under the given inductor options, as
scripts/bench_compile.py does, and prints each width's compile time, inductor's FX graph cache counters
and dynamo's per-phase compile times. ``--profile`` writes cProfile's stats of the compiles; ``--warm-up K``
instead times what a fixed-K speculative decoder's ``warm_up`` compiles, whole, with each bucket's seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_compile import runner_for  # noqa: E402
from bench_fast import SAMPLINGS  # noqa: E402

from specdecpp.models.loading import load_pair  # noqa: E402
from specdecpp_demo.pair import cache_dir  # noqa: E402


def warm_up(draft, target, k: int) -> int:
    from specdecpp.decoders.chain import SpeculativeDecoder
    from specdecpp.fast.step import model_steps
    from specdecpp.stopping.policies import FixedK

    decoder = SpeculativeDecoder(draft, target, FixedK(k), SAMPLINGS["paper"], fast="compile")
    t0 = time.perf_counter()
    decoder.warm_up(64, 64, progress=True)
    print(f"warm-up, fixed K={k}: {time.perf_counter() - t0:.1f} s", flush=True)
    for name, model in (("target", target), ("draft", draft)):
        for key, sec in model_steps(model).compile_seconds.items():
            print(f"  {name} {key}: {sec:.1f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["target", "draft"], default="target")
    ap.add_argument("--widths", default="1")
    ap.add_argument("--options", default="tuned", help="a name of bench_compile.VARIANTS")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--warm-up", type=int, metavar="K",
                    help="instead: what a fixed-K speculative decoder's warm-up compiles (fast='compile', the"
                         " engine's buckets for a prompt of 64 and 64 new tokens), timed whole")
    args = ap.parse_args()
    torch.set_num_threads(1)
    demo = cache_dir()
    draft, target, _ = load_pair(str(demo / "draft"), str(demo / "target"), device="cpu", dtype="bfloat16")
    if args.warm_up:
        return warm_up(draft, target, args.warm_up)
    model = target if args.model == "target" else draft
    widths = [int(w) for w in args.widths.split(",")]
    runner = runner_for(args.options, model, args.size, widths)
    ids = torch.randint(3, model.config.vocab_size, (64 + max(widths),), generator=torch.Generator().manual_seed(1))
    from torch._dynamo.utils import compile_times, counters

    prof = cProfile.Profile() if args.profile else None
    with torch.no_grad():
        runner.feed(ids[:64])
        n = runner.length
        for w in widths:
            counters.clear()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            runner.feed(ids[64:64 + w], n_logits=w)
            if prof:
                prof.disable()
            runner.rollback(n)
            cache = {k: v for k, v in counters["inductor"].items() if "cache" in k}
            print(f"width {w}: {time.perf_counter() - t0:.1f} s; {cache}", flush=True)
    print(compile_times(repr="str", aggregate=True))
    if prof:
        prof.dump_stats(args.profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
