"""Measure a draft/target pair: per-token acceptance, forward-cost ratio and Eq. 2.3 fixed-K speedup.

    python scripts/measure_pair.py                                  # the demo pair
    python scripts/measure_pair.py --draft DIR --target DIR --out reports/pair.json

acceptance: the target samples a response to each held-out prompt (temperature 1, top-k 50);
    at every response position, alpha_i = sum_v min(p_i(v), q_i(v)) with p and q the warped
    (temperature 1, top-k 50) target and draft distributions given the same prefix; the mean of
    alpha_i is the expected acceptance of one drafted token.
cost ratio: median time of one forward pass of one token with a KV cache, batch 1, draft over
    target, measured alternately so that machine load affects both alike; in the same loop the
    target's cost of scoring n = 2..8 tokens at once (a verification of n - 1 candidates).
coverage: for a draft with a reduced output vocabulary, the target's probability mass inside the
    draft's token set (the draft's q is zero outside it).
precision: --dtype (default fast, as conf/pair/demo.yaml: bf16 on CPUs with native bf16 dot products,
    else float32); --compare-dtype float32 times the same pair at float32 in the same loop.
--costs-out FILE: t_draft, t_target and target_by_width as JSON, for
    `python -m infer.potential DATA --costs FILE`.
Eq. 2.3: with per-token acceptance alpha and cost ratio r, fixed K yields (1 - alpha^(K+1)) /
    (1 - alpha) tokens per round at cost K r + 1 target passes: speedup = tokens / cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdecpp import SamplingConfig, load_pair, warp
from specdecpp.loading import dtype_name, load_model, resolve_dtype
from specdecpp.prompts import encode_prompt, load_prompts
from specdecpp.reduced_vocab import ReducedOutput, output_vocab_size

SAMPLING = SamplingConfig(temperature=1.0, top_k=50)


def sample_response(target, prompt_ids: list[int], max_new_tokens: int, eos_token_id, seed: int) -> torch.Tensor:
    """prompt + a response sampled from the target's warped distribution: LongTensor [1, L + n]."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = target(ids, use_cache=True)
        cache = out.past_key_values
        for _ in range(max_new_tokens):
            token = torch.multinomial(warp(out.logits[:, -1], SAMPLING), 1, generator=generator)
            ids = torch.cat([ids, token], dim=1)
            if eos_token_id is not None and token.item() == eos_token_id:
                break
            out = target(token, past_key_values=cache, use_cache=True)
    return ids


def position_acceptance(draft, target, ids: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha_i = sum_v min(p_i(v), q_i(v)) at each response position i, and the target's mass
    p_i(S) on the draft's output set S (1 for a full-vocabulary draft)."""
    with torch.no_grad():
        p = warp(target(ids[:, :-1]).logits[0, prompt_len - 1:], SAMPLING)
        q = warp(draft(ids[:, :-1]).logits[0, prompt_len - 1:, : p.shape[-1]], SAMPLING)
    layer = draft.get_output_embeddings()
    covered = p[:, layer.token_ids].sum(-1) if isinstance(layer, ReducedOutput) else torch.ones(p.shape[0])
    return torch.minimum(p, q).sum(-1), covered


def step_times(models: dict, context: torch.Tensor, steps: int, widths: dict[str, list[int]] | None = None
               ) -> dict[str, dict[int, float]]:
    """Median seconds of one cached forward of n tokens per model (n = 1 and ``widths[name]``),
    batch 1, through the decoding engine's own model call (``specdecpp.engine._Runner.feed``: on a
    CPU it pads 2-3 tokens to 4, as decoding does); every (model, n) in turn in each step, so
    machine load affects all alike."""
    from specdecpp.engine import _Runner
    from specdecpp.reduced_vocab import output_vocab_size

    widths = widths or {}
    jobs = [(name, n) for name in models for n in [1, *[w for w in widths.get(name, []) if w != 1]]]
    runners, times = {}, {job: [] for job in jobs}
    with torch.no_grad():
        for name, model in models.items():
            runners[name] = _Runner(model, output_vocab_size(model), want_hidden=False)
            runners[name].feed(context[0, :-9])
        for i in range(steps + 3):
            for name, n in jobs:
                runner = runners[name]
                length = runner.length
                tokens = context[0, -9 : -9 + n]
                start = time.perf_counter()
                runner.feed(tokens, n_logits=n)
                if i >= 3:  # warm-up steps are not timed
                    times[(name, n)].append(time.perf_counter() - start)
                runner.rollback(length)
    out: dict[str, dict[int, float]] = {}
    for (name, n), t in times.items():
        out.setdefault(name, {})[n] = statistics.median(t)
    return out


def fixed_k_speedup(alpha: float, cost_ratio: float, k: int) -> float:
    """Eq. 2.3 with i.i.d. acceptance: expected tokens per round over the round's cost in target passes."""
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    return tokens / (k * cost_ratio + 1)


def measure(draft_path: str, target_path: str, sources: list[str], limit: int, max_new_tokens: int,
            timing_steps: int, seed: int, dtype: str = "fast", compare_dtypes: tuple[str, ...] = ()) -> dict:
    draft, target, tokenizer = load_pair(draft_path, target_path, device="cpu", dtype=dtype)
    per_source = {}
    for source in sources:
        split = "test"
        prompts = load_prompts(source, split=split, limit=limit)
        alphas, covers, n_tokens = [], [], 0
        for i, prompt in enumerate(tqdm(prompts, desc=f"acceptance on {source}/{split}")):
            prompt_ids = encode_prompt(tokenizer, prompt.prompt)
            ids = sample_response(target, prompt_ids, max_new_tokens, tokenizer.eos_token_id, seed + i)
            alpha, covered = position_acceptance(draft, target, ids, len(prompt_ids))
            alphas.append(alpha)
            covers.append(covered)
            n_tokens += alpha.numel()
        alpha = torch.cat(alphas)
        per_source[source] = {"split": split, "prompts": len(prompts), "positions": n_tokens,
                              "acceptance": alpha.mean().item(), "target_mass_covered": torch.cat(covers).mean().item(),
                              "acceptance_per_prompt_std": torch.stack([a.mean() for a in alphas]).std().item()}
    context = sample_response(target, encode_prompt(tokenizer, load_prompts(sources[0], "test", 1)[0].prompt),
                              64, None, seed)  # a prompt and 64 response tokens: a mid-generation cache
    models = {"draft": draft, "target": target}
    others = {dtype_name(d) for d in (resolve_dtype(x, draft.device) for x in compare_dtypes)} - {dtype_name(target.dtype)}
    for name in sorted(others):  # the same pair at another precision, timed in the same loop
        models[f"draft@{name}"] = load_model(draft_path, "cpu", name)
        models[f"target@{name}"] = load_model(target_path, "cpu", name)
    timed = step_times(models, context, timing_steps,
                       {name: list(range(2, 9)) for name in models if name.startswith("target")})
    times = {name: t[1] for name, t in timed.items()}
    compare = {name: {"draft_step_s": times[f"draft@{name}"], "target_step_s": times[f"target@{name}"],
                      "cost_ratio": times[f"draft@{name}"] / times[f"target@{name}"],
                      "target_by_width_s": timed[f"target@{name}"]} for name in sorted(others)}
    ratio = times["draft"] / times["target"]
    overall = sum(s["acceptance"] * s["positions"] for s in per_source.values()) / sum(
        s["positions"] for s in per_source.values())
    speedups = {k: fixed_k_speedup(overall, ratio, k) for k in range(1, 21)}
    best_k = max(speedups, key=speedups.get)
    return {"draft": draft_path, "target": target_path, "dtype": dtype_name(target.dtype),
            "compare_dtypes": compare, "sampling": SAMPLING.to_dict(),
            "max_new_tokens": max_new_tokens, "seed": seed, "threads": torch.get_num_threads(),
            "per_source": per_source, "acceptance": overall,
            "draft_step_s": times["draft"], "target_step_s": times["target"], "cost_ratio": ratio,
            "target_by_width_s": timed["target"], "draft_output_vocab": output_vocab_info(draft),
            "fixed_k_speedup": speedups, "best_k": best_k, "best_fixed_k_speedup": speedups[best_k]}


def output_vocab_info(draft) -> dict:
    layer = draft.get_output_embeddings()
    scored = int(layer.token_ids.numel()) if isinstance(layer, ReducedOutput) else int(layer.weight.shape[0])
    return {"scored_tokens": scored, "vocab_size": output_vocab_size(draft)}


def table(result: dict) -> str:
    rows = [("source", "prompts", "positions", "acceptance", "target mass in draft vocabulary")]
    rows += [(name, str(s["prompts"]), str(s["positions"]), f"{s['acceptance']:.3f}", f"{s['target_mass_covered']:.4f}")
             for name, s in result["per_source"].items()]
    rows.append(("all", "", str(sum(s["positions"] for s in result["per_source"].values())),
                 f"{result['acceptance']:.3f}", ""))
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    lines += ["", f"draft step {result['draft_step_s'] * 1e3:.1f} ms, target step "
              f"{result['target_step_s'] * 1e3:.1f} ms, cost ratio {result['cost_ratio']:.3f} "
              f"({result['threads']} threads; draft scores {result['draft_output_vocab']['scored_tokens']} of "
              f"{result['draft_output_vocab']['vocab_size']} tokens)",
              "target cost of scoring n tokens after a cached prefix (ms): " + ", ".join(
                  f"n={n}: {t * 1e3:.1f}" for n, t in sorted(result["target_by_width_s"].items())),
              "Eq. 2.3 fixed-K speedup: " + ", ".join(f"K={k}: {result['fixed_k_speedup'][k]:.2f}x"
                                                      for k in (1, 2, 3, 4, 6, 8)),
              f"best K = {result['best_k']}: {result['best_fixed_k_speedup']:.2f}x over target-only"]
    if result.get("dtype"):
        lines.insert(len(rows) + 2, f"precision: {result['dtype']}")
    for name, c in result.get("compare_dtypes", {}).items():
        lines.append(f"same loop, {name}: draft step {c['draft_step_s'] * 1e3:.1f} ms, target step "
                     f"{c['target_step_s'] * 1e3:.1f} ms, cost ratio {c['cost_ratio']:.3f}; target by width (ms): "
                     + ", ".join(f"n={n}: {t * 1e3:.1f}" for n, t in sorted(c["target_by_width_s"].items())))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", help="draft model (default: the demo draft, materialised on first use)")
    parser.add_argument("--target", help="target model (default: the demo target, materialised on first use)")
    parser.add_argument("--sources", nargs="+", default=["bundled", "humaneval"],
                        help="prompt sources, test split of each (default: bundled humaneval)")
    parser.add_argument("--limit", type=int, default=20, help="prompts per source")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--timing-steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="fast", help="precision of both models: fast (default, as the demo pair: "
                        "bf16 on CUDA and on CPUs with native bf16, else float32) | auto | float32 | bfloat16 | float16")
    parser.add_argument("--compare-dtype", nargs="*", default=[], metavar="DTYPE",
                        help="also time the pair at these precisions in the same loop (e.g. float32)")
    parser.add_argument("--out", type=Path, default=Path("reports/demo/pair.json"))
    parser.add_argument("--costs-out", type=Path, help="also write t_draft, t_target, target_by_width "
                        "(JSON for python -m infer.potential --costs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.draft is None or args.target is None:
        from specdecpp_demo import demo_draft_path, demo_target_path

        args.target = args.target or str(demo_target_path())
        args.draft = args.draft or str(demo_draft_path())
    result = measure(args.draft, args.target, args.sources, args.limit, args.max_new_tokens,
                     args.timing_steps, args.seed, args.dtype, tuple(args.compare_dtype))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.costs_out:
        args.costs_out.parent.mkdir(parents=True, exist_ok=True)
        args.costs_out.write_text(json.dumps({"t_draft": result["draft_step_s"], "t_target": result["target_step_s"],
                                              "target_by_width": result["target_by_width_s"],
                                              "dtype": result["dtype"], "measured_by": "scripts/measure_pair.py",
                                              "threads": result["threads"]}, indent=1))
    print(table(result))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
