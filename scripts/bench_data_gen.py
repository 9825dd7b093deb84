"""Throughput of data_gen's work (target sampling + labelling) batched versus one prompt at a time.

    python scripts/bench_data_gen.py --draft PATH --target PATH [--batch-sizes 1 8] [--prompts 16]
        [--max-new-tokens 64] [--threads 1] [--plot reports/bench_data_gen.png]

Both models are loaded once; every batch size labels the same prompts (bundled test split) with the
same per-prompt generators, as data_gen does (continuous batching while sampling, the target's p
kept for the labels). Reported: target tokens per second for sampling X alone and for the
whole step (sampling X, then the draft and target forwards that label it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from specdecpp.core.sampling import SamplingConfig
from specdecpp.data.labels import (
    label_responses,
    prompt_generator,
    sample_responses_with_probs,
    shared_vocab,
)
from specdecpp.data.prompts import encode_prompt, load_prompts
from specdecpp.models.loading import load_pair


def measure(draft, target, encoded, ids, batch_size, sampling, max_new_tokens, eos, vocab) -> dict:
    """Label every prompt as data_gen's label_shard does: ``batch_size`` rows continuously batched
    while sampling (shortest prompts first), then labelled ``batch_size`` at a time; time both phases."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    gens = [prompt_generator(0, ids[i], target.device) for i in order]
    prompts = [encoded[i] for i in order]
    t0 = _now(target.device)
    responses, kept = sample_responses_with_probs(target, prompts, sampling, max_new_tokens, gens, eos, vocab=vocab,
                                                  batch_size=batch_size)
    t1 = _now(target.device)
    by_length = sorted(range(len(order)), key=lambda j: len(prompts[j]) + len(responses[j]))
    for start in range(0, len(by_length), batch_size):
        batch = by_length[start:start + batch_size]
        label_responses(draft, target, [prompts[j] for j in batch], [responses[j] for j in batch], sampling,
                        [gens[j] for j in batch], vocab=vocab,
                        target_probs=None if kept is None else [kept[j] for j in batch])
    t2 = _now(target.device)
    sample_s, label_s = t1 - t0, t2 - t1
    tokens = sum(len(r) for r in responses)
    return {"batch_size": batch_size, "tokens": tokens, "sample_s": sample_s, "label_s": label_s,
            "sample_tok_s": tokens / sample_s, "total_tok_s": tokens / (sample_s + label_s)}


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def plot(results: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["batch_size"] for r in results]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(sizes, [r["sample_tok_s"] for r in results], "o-", label="sampling X")
    ax.plot(sizes, [r["total_tok_s"] for r in results], "s-", label="sampling + labels")
    ax.set(xscale="log", xlabel="prompts per batch", ylabel="target tokens / s", title=title)
    ax.minorticks_off()
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompts", type=int, default=16, help="bundled test prompts to label")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--plot", type=Path, default=None, help="also save a PNG of tokens/s by batch size")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    draft, target, tokenizer = load_pair(args.draft, args.target, device=args.device, dtype=args.dtype)
    prompts = load_prompts("bundled", "test", limit=args.prompts)
    encoded = [encode_prompt(tokenizer, p.prompt) for p in prompts]
    ids = [p.id for p in prompts]
    sampling = SamplingConfig(args.temperature, args.top_k)
    eos, vocab = tokenizer.eos_token_id, shared_vocab(draft, target)
    measure(draft, target, encoded[:1], ids[:1], 1, sampling, 4, eos, vocab)  # warm-up
    results = [measure(draft, target, encoded, ids, b, sampling, args.max_new_tokens, eos, vocab)
               for b in args.batch_sizes]

    title = f"{'/'.join(Path(args.target).parts[-2:])}, {target.device.type}, {args.threads} thread(s)"
    table = Table(title=f"data_gen throughput: {title}; {len(prompts)} prompts, max {args.max_new_tokens} tokens")
    for column in ("batch", "target tokens", "sampling s", "labelling s", "sampling tok/s", "total tok/s", "speed-up"):
        table.add_column(column, justify="right")
    base = results[0]["total_tok_s"]
    for r in results:
        table.add_row(str(r["batch_size"]), str(r["tokens"]), f"{r['sample_s']:.2f}", f"{r['label_s']:.2f}",
                      f"{r['sample_tok_s']:.1f}", f"{r['total_tok_s']:.1f}", f"{r['total_tok_s'] / base:.2f}x")
    Console().print(table)
    if args.plot:
        plot(results, title, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
