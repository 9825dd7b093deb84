"""Two models of the same shapes, other weights, one inductor cache (research/compile_time, experiment 2).

    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) SPECDECPP_CACHE=.cache PYTHONPATH=.
    for seed in 0 1 0; do python research/compile_time/same_shapes.py $seed; done            # the engine's key
    for seed in 0 1 0; do python research/compile_time/same_shapes.py $seed --naive; done    # (a fresh cache dir)

Builds the demo draft's config with random weights (``seed``), compiles its one-token bucket
(``fast="compile"``, the CPU's tuned settings, bf16) and prints the largest logit difference to the eager
forward, whether the argmax agrees, and inductor's FX graph cache counters. ``--naive`` keys a packed
weight by its shape and dtype only (the check lets it through, nothing more), as inductor keys other
frozen weights: the second seed then loads the first seed's compiled graph and computes with its blocked
weights. Without it the engine's key (the ``packed_cache`` piece of ``specdecpp.fast.torch_internals``,
opted in here: a digest of the values) makes the
second seed miss and the third (the first's weights again) hit.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_fast import demo_configs, random_model  # noqa: E402

from specdecpp.fast import torch_internals as packed_cache  # noqa: E402
from specdecpp.fast.compiling import TUNED_COMPILE_OPTIONS  # noqa: E402
from specdecpp.fast.runners import StaticRunner  # noqa: E402
from specdecpp.models.runner import ModelRunner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("seed", type=int)
    ap.add_argument("--naive", action="store_true", help="key packed weights by shape and dtype only")
    args = ap.parse_args()
    os.environ.setdefault("SPECDECPP_TORCH_INTERNALS", "packed_cache")  # the piece this study is about (off by default)
    if args.naive:
        packed_cache.packed_key = lambda t: ("mkldnn", tuple(t.shape), str(t.dtype))
    torch.set_num_threads(1)
    model = random_model(demo_configs()[0], "cpu", torch.bfloat16, args.seed)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1,), generator=torch.Generator().manual_seed(0))
    eager, _ = ModelRunner(model, vocab, False).feed(ids, 1)
    runner = StaticRunner(model, vocab, False, fast="compile", max_len=64, buckets=(1,), cover=False)
    runner.compile_options = dict(TUNED_COMPILE_OPTIONS["cpu"])
    compiled, _ = runner.feed(ids, 1)
    from torch._dynamo.utils import counters

    cache = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")}
    print(f"seed {args.seed}{' (naive key)' if args.naive else ''}: max |compiled - eager| "
          f"{(compiled.float() - eager.float()).abs().max().item():.4g}, argmax equal "
          f"{torch.equal(compiled.argmax(-1), eager.argmax(-1))}, {cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
