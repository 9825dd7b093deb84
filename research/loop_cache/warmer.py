"""Experiment 15 (research/loop_cache/README.md): a second process on the other core replays the
decoding loop warm, without stopping, so that the shared libraries' code (torch, numpy, CPython:
file-backed pages, the same physical memory in every process) stays in the shared L3 while the main
process's forwards stream their weights through it.

    taskset -c 1 python research/loop_cache/warmer.py --methods fixed_k3 &   # until killed
    taskset -c 0 python scripts/loop_alone.py --methods fixed_k3 ...

It takes scripts/loop_alone.py's arguments; it records each (method, prompt) once, then replays warm
forever (no flush). Not part of the product; not tested.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import loop_alone  # noqa: E402
from bench_fast import SAMPLINGS, load, methods, prompts  # noqa: E402

from specdecpp.decoders.chain import SpeculativeDecoder  # noqa: E402
from specdecpp.models import static  # noqa: E402
from specdecpp.models.loading import eos_token_ids  # noqa: E402


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", nargs="+", default=["fixed_k3"])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--head")
    args = ap.parse_args()
    args.draft = args.target = args.configs = None
    args.random, args.dtype, args.device, args.sampling = False, "fast", "cpu", "paper"
    args.svip_threshold, args.svip_max, args.head_threshold, args.head_max = 0.3, 3, 0.5, 3
    args.prompt_len, args.seed = 64, 0
    torch.set_num_threads(1)
    draft, target, tokenizer, _ = load(args, torch.device("cpu"))
    eos = eos_token_ids(tokenizer, draft, target)
    ids = prompts(args, tokenizer, target.config.vocab_size, torch.device("cpu"))
    tape = loop_alone.StepTape(1)
    static.static_step = tape
    work = []
    for name in args.methods:
        decoder = SpeculativeDecoder(draft, target, methods(args, draft)[name], SAMPLINGS["paper"], fast="static")
        for i, p in enumerate(ids):
            tape.start("record")
            decoder.generate(p, args.max_new_tokens, torch.Generator().manual_seed(i), eos_token_id=eos)
            work.append((decoder, p, i, tape.outputs))
    print("warmer: replaying", flush=True)
    while True:
        for decoder, p, i, outputs in work:
            tape.outputs = outputs
            tape.start("replay")
            decoder.generate(p, args.max_new_tokens, torch.Generator().manual_seed(i), eos_token_id=eos)


if __name__ == "__main__":
    main()
