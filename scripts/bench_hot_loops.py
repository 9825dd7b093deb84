"""Benchmark of the decoding and labelling hot loops on random models (no downloads).

    OMP_NUM_THREADS=1 python scripts/bench_hot_loops.py            # CPU, 1 thread
    python scripts/bench_hot_loops.py --device cuda --threads 0

Prints, for a random Llama pair (sizes below), the median tokens/s of ``SpeculativeDecoder`` with
FixedK(4) and SpecDecPP (depth-3 head) under greedy and T=1 sampling, the median time of one
draft step (forward as the engine calls it) with and without the hidden state, and the peak memory
that data_gen's labelling (``label_responses``) adds for a batch of long responses. Uses only the
public API, so the same script measures an older checkout (PYTHONPATH=that checkout).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch


def tiny_llama(vocab: int, hidden: int, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=4096, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float().eval().requires_grad_(False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_speed(draft, target, policy, sampling, device, prompt_len: int, new: int, repeats: int) -> float:
    from specdecpp import SpeculativeDecoder

    decoder = SpeculativeDecoder(draft, target, policy, sampling)
    prompt = torch.randint(0, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    decoder.generate(prompt, 8, generator=torch.Generator().manual_seed(0))  # warm-up
    speeds = []
    for r in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = decoder.generate(prompt, new, generator=torch.Generator().manual_seed(r))
        sync(device)
        speeds.append(out.stats.n_generated / (time.perf_counter() - t0))
    return statistics.median(speeds)


def draft_step_ms(draft, device, hidden: bool, repeats: int = 30) -> float:
    """One cached single-token draft forward, as the engine makes it (with/without hidden states)."""
    from specdecpp.core.compat import cache_kwargs
    from specdecpp.core.hooks import crop_to, new_cache
    from specdecpp.core.timing import time_forward

    ids = torch.randint(0, 1000, (1, 200), generator=torch.Generator().manual_seed(2)).to(device)
    cache = new_cache(draft)
    draft(ids[:, :-1], use_cache=True, **cache_kwargs(draft, cache), logits_to_keep=1)
    timing = time_forward(lambda: draft(ids[:, -1:], use_cache=True, **cache_kwargs(draft, cache),
                                        output_hidden_states=hidden, logits_to_keep=1),
                          reset=lambda: crop_to(cache, 199), repeats=repeats)
    return 1000 * timing.median


def labelling_peak_mb(draft, target, device, batch: int, length: int) -> float:
    from specdecpp import SamplingConfig
    from specdecpp.data.labels import label_responses

    prompts = [[1, 2, 3, 4]] * batch
    responses = [torch.randint(5, 1000, (length,), generator=torch.Generator().manual_seed(b)).tolist()
                 for b in range(batch)]
    gens = [torch.Generator(device).manual_seed(b) for b in range(batch)]
    sampling = SamplingConfig(temperature=1.0, top_k=50)
    label_responses(draft, target, prompts[:1], [responses[0][:8]], sampling, gens[:1])  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        label_responses(draft, target, prompts, responses, sampling, gens)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    label_responses(draft, target, prompts, responses, sampling, gens)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB -> MiB (Linux)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave as is)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label-batch", type=int, default=4)
    parser.add_argument("--label-length", type=int, default=512)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: decode,step,label")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    skip = set(filter(None, args.skip.split(",")))
    draft = tiny_llama(args.vocab, 256, 4, seed=1).to(device)
    target = tiny_llama(args.vocab, 512, 8, seed=2).to(device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, vocab {args.vocab}, "
          f"draft 256x4, target 512x8")

    from specdecpp import AcceptanceHead, FixedK, SamplingConfig, SpecDecPP

    if "decode" not in skip:
        head = AcceptanceHead(256, 3)
        torch.nn.init.zeros_(head.out.weight)
        torch.nn.init.constant_(head.out.bias, 2.0)  # sigmoid 0.88: rounds of a few candidates
        for name, sampling in (("greedy", SamplingConfig(temperature=0)), ("T=1", SamplingConfig(temperature=1.0))):
            for label, policy in (("FixedK(4)", FixedK(4)), ("SpecDecPP(d3, h=0.7)", SpecDecPP(head, 0.7))):
                tps = decode_speed(draft, target, policy, sampling, device, 64, args.new_tokens, args.repeats)
                print(f"decode {name:>6} {label:<22} {tps:8.1f} tokens/s (median of {args.repeats})")
    if "step" not in skip:
        print(f"draft step, cached 200-token prefix: {draft_step_ms(draft, device, True):.3f} ms with "
              f"output_hidden_states, {draft_step_ms(draft, device, False):.3f} ms without")
    if "label" not in skip:
        mb = labelling_peak_mb(draft, target, device, args.label_batch, args.label_length)
        print(f"label_responses batch {args.label_batch} x {args.label_length} tokens: peak +{mb:.0f} MiB")


if __name__ == "__main__":
    main()
