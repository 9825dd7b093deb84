"""Cost of one verification forward in the number of tokens n, after a cached prefix.

    OMP_NUM_THREADS=1 python scripts/bench_verify_cost.py                       # random SmolLM2-135M shape
    OMP_NUM_THREADS=1 python scripts/bench_verify_cost.py --model .cache/demo/target --draft .cache/demo/draft

For n = 1..8: the median (of --repeats) time of ``model(n tokens, past_key_values=cache of a
--prefix-token prompt, logits_to_keep=n)``, the target call that verifies n - 1 candidates (and
the draft call that feeds n tokens after a rollback), then the same through the engine's runner,
which pads n > 1 tokens on CPU to a multiple of 4 (the CPU GEMM is slower for 2-3 rows than for 4,
above all in the output layer: Linear(576, 49152) took 9.9, 24.8, 34.8, 16.9 ms for 1-4 rows). Without
--model a random Llama with SmolLM2-135M's shape is used (no download). ``--parts`` also times
the pieces (linear layers alone, attention alone) to locate a non-monotone step.
"""

from __future__ import annotations

import argparse

import torch

from specdecpp.core.compat import cache_kwargs
from specdecpp.core.timing import time_forward


def smollm_shape(seed: int = 0, layers: int = 30):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, rope_theta=100000.0)
    return LlamaForCausalLM(cfg).float().eval().requires_grad_(False)


@torch.no_grad()
def forward_ms(model, prefix: int, n: int, repeats: int) -> float:
    from specdecpp.core.hooks import crop_to, new_cache

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prefix + n), generator=torch.Generator().manual_seed(0))
    cache = new_cache(model)
    model(ids[:, :prefix], use_cache=True, **cache_kwargs(model, cache), logits_to_keep=1)
    timing = time_forward(lambda: model(ids[:, prefix:], use_cache=True, **cache_kwargs(model, cache),
                                        logits_to_keep=n),
                          reset=lambda: crop_to(cache, prefix), repeats=repeats, warmup=1)
    return 1000 * timing.median


def engine_feed_ms(model, prefix: int, max_n: int, repeats: int) -> list[float]:
    """The same calls, n = 1..max_n, through the engine's runner (``ModelRunner.feed``: what
    SpeculativeDecoder does), timed as decoders' forwards are (``time_cached_forwards``)."""
    from specdecpp.models.runner import time_cached_forwards

    ids = torch.randint(0, model.config.vocab_size, (prefix + max_n,), generator=torch.Generator().manual_seed(0))
    times = time_cached_forwards({"model": model}, ids[:prefix], ids[prefix:], {"model": range(1, max_n + 1)},
                                 repeats=repeats, warmup=1)["model"]
    return [1000 * times[n] for n in range(1, max_n + 1)]


@torch.no_grad()
def parts_ms(model, prefix: int, n: int, repeats: int) -> dict:
    """The layers' linear maps alone and one layer's attention alone (SDPA as the model calls it)."""
    cfg = model.config
    h = torch.randn(1, n, cfg.hidden_size)
    layer = model.model.layers[0]
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(1, heads, n, dim)
    k = torch.randn(1, heads, prefix + n, dim)
    v = torch.randn(1, heads, prefix + n, dim)
    mask = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)[None, None]

    def timed(fn) -> float:
        return 1000 * time_forward(fn, repeats=repeats, warmup=1).median

    def all_linears():
        for lin in linears:
            lin(h if lin.in_features == cfg.hidden_size else torch.randn(1, n, lin.in_features))

    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {"linears/layer": timed(all_linears),
            "sdpa mask": timed(lambda: sdpa(q, k, v, attn_mask=mask)),
            "sdpa no mask": timed(lambda: sdpa(q, k, v)),
            "kv heads": kv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an HF model directory (default: a random SmolLM2-135M-shaped Llama)")
    parser.add_argument("--draft", help="a second model to time the same way")
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--max-n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specdecpp.models.loading import load_model

    models = {"target": load_model(args.model, "cpu") if args.model else smollm_shape()}
    if args.draft:
        models["draft"] = load_model(args.draft, "cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), prefix {args.prefix}, "
          f"median of {args.repeats}")
    for name, model in models.items():
        row = [forward_ms(model, args.prefix, n, args.repeats) for n in range(1, args.max_n + 1)]
        print(f"{name:>6} model forward ms, n=1..{args.max_n}: " + " ".join(f"{t:7.2f}" for t in row))
        row = engine_feed_ms(model, args.prefix, args.max_n, args.repeats)
        print(f"{name:>6} engine feed ms,   n=1..{args.max_n}: " + " ".join(f"{t:7.2f}" for t in row))
        if args.parts:
            for n in range(1, args.max_n + 1):
                print(f"    n={n}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in parts_ms(model, args.prefix, n, args.repeats).items()))


if __name__ == "__main__":
    main()
