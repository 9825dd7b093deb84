"""Hugging Face assisted generation with and without GatherKeptLogits (infer/hf_assisted.py).

    python scripts/bench_hf_keep.py --prompts 6 --max-new-tokens 64        # the demo pair, bf16 where fast

transformers' draft calls feed the 2-3 tokens accepted since the last round and keep one logit by
slicing the hidden state, which on a CPU in bf16 takes oneDNN's slow path. This times the harness's
own ``HFAssistedRunner`` (what ``method=hf_assisted`` runs; --mode, --num-assistant-tokens) on
bundled test prompts, with ``GatherKeptLogits`` and with it swapped for a no-op, interleaved prompt by prompt with the
same seed, checks that both produce the same tokens, and prints tokens/s of each (pooled) with the paired
ratio and its 95% bootstrap interval over prompts (infer.summary.paired_speedup_ci), plus the mean
time of a draft call of each kind.
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import torch


def tokens_per_s(rows: list[dict]) -> float:
    """Pooled, as infer.report computes it: all tokens over all wall time."""
    return sum(r["n_generated"] for r in rows) / sum(r["wall_time_s"] for r in rows)


def main() -> None:
    import infer.hf_assisted as hf
    from infer.summary import paired_speedup_ci
    from specdecpp.core.sampling import SamplingConfig
    from specdecpp.data.prompts import encode_prompt, load_prompts
    from specdecpp.models.loading import dtype_name, load_model, load_tokenizer
    from specdecpp_demo import demo_draft_path, demo_target_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft")
    ap.add_argument("--target")
    ap.add_argument("--dtype", default="fast")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--mode", default="constant", choices=["constant", "heuristic", "confidence"])
    ap.add_argument("--num-assistant-tokens", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draft_ref, target_ref = args.draft or str(demo_draft_path()), args.target or str(demo_target_path())
    draft = load_model(draft_ref, device="cpu", dtype=args.dtype)
    target = load_model(target_ref, device="cpu", dtype=args.dtype)
    tok = load_tokenizer(target_ref)
    runner = hf.HFAssistedRunner(draft, target, SamplingConfig(temperature=1.0, top_k=50), args.mode,
                                 args.num_assistant_tokens, confidence_threshold=0.4)
    gather = hf.GatherKeptLogits

    def run(ids, seed: int, gathered: bool):
        """The harness's own HFAssistedRunner.generate; plain = GatherKeptLogits swapped for a no-op."""
        hf.GatherKeptLogits = gather if gathered else (lambda *models: contextlib.nullcontext())
        try:
            return runner.generate(ids, args.max_new_tokens, seed, tok.eos_token_id)
        finally:
            hf.GatherKeptLogits = gather

    prompts = load_prompts("bundled", "test", limit=args.prompts)
    run(torch.tensor([encode_prompt(tok, prompts[0].prompt)]), 0, True)  # warm-up, untimed
    rows, draft_ms = {False: [], True: []}, {False: [], True: []}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([encode_prompt(tok, prompt.prompt)])
        outs = {}
        for gathered in ((False, True) if i % 2 == 0 else (True, False)):  # alternate who goes first
            out, stats, _ = run(ids, i, gathered)
            outs[gathered] = out
            rows[gathered].append({"prompt_id": prompt.id, "timed": True, "n_generated": stats.n_generated,
                                   "wall_time_s": stats.wall_time_s})
            draft_ms[gathered].append(1000 * stats.draft_time_s / max(stats.n_draft_calls, 1))
        print(f"prompt {i}: plain {tokens_per_s(rows[False][-1:]):.2f} tok/s, gathered "
              f"{tokens_per_s(rows[True][-1:]):.2f} tok/s, same tokens: {outs[False] == outs[True]}", flush=True)
    plain, gathered = tokens_per_s(rows[False]), tokens_per_s(rows[True])
    lo, hi = paired_speedup_ci(rows[True], rows[False], n_boot=2000)
    print(f"\n{dtype_name(target.dtype)}, {args.threads} thread(s), {len(prompts)} bundled test prompts x "
          f"{args.max_new_tokens} tokens, T=1/top-k 50, HF assisted {args.mode} n={args.num_assistant_tokens}")
    print(f"plain:    {plain:.2f} tok/s, draft call {np.mean(draft_ms[False]):.2f} ms")
    print(f"gathered: {gathered:.2f} tok/s, draft call {np.mean(draft_ms[True]):.2f} ms")
    print(f"ratio gathered / plain: {gathered / plain:.3f}x [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
