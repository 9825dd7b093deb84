"""A decode on buckets loaded from inductor's cache against one on buckets compiled in the process
(research/compile_time, experiment 2): the same tokens, and the same speed.

    export SPECDECPP_CACHE=.cache PYTHONPATH=. TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    python research/compile_time/cached_decode.py --out a.json                           # compiles, saves
    python research/compile_time/cached_decode.py --out b.json                           # loads
    SPECDECPP_TORCH_INTERNALS=none python research/compile_time/cached_decode.py --out c.json  # compiles again
    python research/compile_time/cached_decode.py --compare a.json b.json c.json

The demo pair (bf16, 1 thread), ``SpeculativeDecoder`` with ``FixedK(3)`` and ``fast="compile"``: its
``warm_up`` timed, then greedy and sampled (T = 1, top-k 50, seeded) decodes of a few fixed prompts,
each timed. ``--compare`` checks that every file holds the same tokens and prints the times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_fast import SAMPLINGS  # noqa: E402

from specdecpp.decoders.chain import SpeculativeDecoder  # noqa: E402
from specdecpp.models.loading import eos_token_ids, load_pair  # noqa: E402
from specdecpp.stopping.policies import FixedK  # noqa: E402
from specdecpp_demo.pair import cache_dir  # noqa: E402

PROMPTS = ["Write a haiku about the sea.", "Explain what a hash table is.", "List three prime numbers."]


def decode(out: str, tokens: int) -> None:
    torch.set_num_threads(1)
    demo = cache_dir()
    draft, target, tokenizer = load_pair(str(demo / "draft"), str(demo / "target"), device="cpu", dtype="bfloat16")
    eos = eos_token_ids(tokenizer, draft, target)
    ids = [torch.tensor([tokenizer(p)["input_ids"]]) for p in PROMPTS]
    result = {"warm_up_s": {}, "tokens": {}, "seconds": {}}
    for name, sampling in SAMPLINGS.items():
        decoder = SpeculativeDecoder(draft, target, FixedK(3), sampling, fast="compile")
        t0 = time.perf_counter()
        decoder.warm_up(max(i.shape[1] for i in ids), tokens)
        result["warm_up_s"][name] = time.perf_counter() - t0
        for i, prompt in enumerate(ids):
            t0 = time.perf_counter()
            got = decoder.generate(prompt, tokens, torch.Generator().manual_seed(i), eos_token_id=eos)
            result["seconds"][f"{name}/{i}"] = time.perf_counter() - t0
            result["tokens"][f"{name}/{i}"] = got.tokens.tolist()
        print(name, f"warm-up {result['warm_up_s'][name]:.1f} s", flush=True)
    Path(out).write_text(json.dumps(result))


def compare(files: list[str]) -> int:
    runs = [json.loads(Path(f).read_text()) for f in files]
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    for f, r in zip(files, runs, strict=True):
        print(f, "warm-up s", {k: round(v, 1) for k, v in r["warm_up_s"].items()}, "decode s",
              round(sum(r["seconds"].values()), 2))
    print("the same tokens in every file:", same)
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--compare", nargs="+")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare)
    decode(args.out, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
