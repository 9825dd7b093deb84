"""Hugging Face assisted generation with and without GatherKeptLogits (infer/hf_assisted.py).

    python scripts/bench_hf_keep.py --prompts 6 --max-new-tokens 64        # the demo pair, bf16 where fast

transformers' draft calls feed the 2-3 tokens accepted since the last round and keep one logit by
slicing the hidden state, which on a CPU in bf16 takes oneDNN's slow path. This times the same
``target.generate(assistant_model=draft)`` calls (constant schedule, --num-assistant-tokens) on
bundled test prompts, plain and inside ``GatherKeptLogits``, interleaved prompt by prompt with the
same seed, checks that both produce the same tokens, and prints tokens/s of each with the paired
ratio and its 95% bootstrap interval over prompts, plus the mean time of a draft call of each kind.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np
import torch


def main() -> None:
    from specdecpp.demo import demo_draft_path, demo_target_path
    from specdecpp.models import GatherKeptLogits, dtype_name, load_model, load_tokenizer
    from specdecpp.prompts import encode_prompt, load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft")
    ap.add_argument("--target")
    ap.add_argument("--dtype", default="fast")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-assistant-tokens", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draft_ref, target_ref = args.draft or str(demo_draft_path()), args.target or str(demo_target_path())
    draft = load_model(draft_ref, device="cpu", dtype=args.dtype)
    target = load_model(target_ref, device="cpu", dtype=args.dtype)
    tok = load_tokenizer(target_ref)
    draft.generation_config.num_assistant_tokens = args.num_assistant_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft_times = {False: [], True: []}

    def timed(hooked: bool):
        starts = []
        pre = draft.register_forward_pre_hook(lambda *a: starts.append(time.perf_counter()))
        post = draft.register_forward_hook(lambda *a: draft_times[hooked].append(time.perf_counter() - starts[-1]))
        return pre, post

    rates = {False: [], True: []}
    prompts = load_prompts("bundled", "test", limit=args.prompts)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([encode_prompt(tok, prompt.prompt)])
        outs = {}
        for hooked in ((False, True) if i % 2 == 0 else (True, False)):  # alternate who goes first
            handles = timed(hooked)
            ctx = GatherKeptLogits(draft, target) if hooked else contextlib.nullcontext()
            torch.manual_seed(i)
            with ctx, torch.no_grad():
                t0 = time.perf_counter()
                out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                                      do_sample=True, top_k=50, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                      min_new_tokens=args.max_new_tokens, pad_token_id=tok.eos_token_id)
                wall = time.perf_counter() - t0
            for h in handles:
                h.remove()
            outs[hooked] = out
            rates[hooked].append((out.shape[1] - ids.shape[1]) / wall)
        same = torch.equal(outs[False], outs[True])
        print(f"prompt {i}: plain {rates[False][-1]:.2f} tok/s, gathered {rates[True][-1]:.2f} tok/s, "
              f"same tokens: {same}", flush=True)
    plain, gathered = np.array(rates[False]), np.array(rates[True])
    rng = np.random.default_rng(0)
    boots = [gathered[idx].mean() / plain[idx].mean()
             for idx in (rng.integers(0, len(plain), len(plain)) for _ in range(2000))]
    lo, hi = np.quantile(boots, [0.025, 0.975])
    print(f"\n{dtype_name(target.dtype)}, {args.threads} thread(s), {len(prompts)} prompts x {args.max_new_tokens} "
          f"tokens, HF assisted constant n={args.num_assistant_tokens}")
    print(f"plain:    {plain.mean():.2f} tok/s, draft call {1000 * np.mean(draft_times[False]):.2f} ms")
    print(f"gathered: {gathered.mean():.2f} tok/s, draft call {1000 * np.mean(draft_times[True]):.2f} ms")
    print(f"ratio gathered / plain: {gathered.mean() / plain.mean():.3f}x [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
