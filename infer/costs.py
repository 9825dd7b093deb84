"""python -m infer.costs [--pair demo | --draft D --target T] --costs-out FILE: what a pair costs.

Measures a draft/target pair side by side: per-forward costs (the cost model's ``costs.json``,
``specdecpp.analysis.costmodel``), per-token acceptance and Eq. 2.3's fixed-K speedup.

    python -m infer.costs --costs-out reports/demo/costs.json              # the demo pair (conf/pair/demo.yaml)
    python -m infer.costs --draft DIR --target DIR --out reports/pair.json --costs-out reports/costs.json

costs: median seconds of one cached forward of one token, batch 1, draft and target, through the
    decoding engine's own model call, timed by ``specdecpp.core.timing.time_forwards``
    (``torch.utils.benchmark.Timer``: CUDA-synchronised) and interleaved call by call so that
    machine load affects both alike; in the same loop the target's cost of scoring n = 2..8 tokens
    at once (a verification of n - 1 candidates): the width curve t_target(n), and the draft's
    t_draft(n) (a token tree's level of n nodes, specdecpp.analysis.tree_search). --max-width W extends
    both curves to 12, 16, 24, 32, 48, 64, 96, 128, ... up to W (token trees of Sequoia's sizes).
acceptance: the target samples a response to each held-out prompt (temperature 1, top-k 50);
    at every response position, alpha_i = sum_v min(p_i(v), q_i(v)) with p and q the warped
    (temperature 1, top-k 50) target and draft distributions given the same prefix; the mean of
    alpha_i is the expected acceptance of one drafted token.
coverage: for a draft with a reduced output vocabulary, the target's probability mass inside the
    draft's token set (the draft's q is zero outside it).
precision: --dtype (default: the pair config's, fast for the demo pair: bf16 on CPUs with native
    bf16 dot products, else float32); --compare-dtype float32 times the same pair at float32 in the
    same loop.
--batch-sizes B ...: also t_draft(B) and t_target(B, n) (B rows of n tokens each, n <= 21) through
    the batched engine's forward (specdecpp.decoders.batch.BatchRunner), for the batched Eq. 2.3.
--costs-out FILE: the one ``costs.json`` schema (t_draft, t_target, target_by_width, draft_by_width,
    draft_by_batch, target_by_batch, provenance),
    read by ``python -m infer.potential --costs`` and ``python -m infer.report --costs``;
--out FILE: everything measured (acceptance per prompt source, the fixed-K table) as JSON.
Eq. 2.3: with per-token acceptance alpha and cost ratio r, fixed K yields (1 - alpha^(K+1)) /
    (1 - alpha) tokens per round at cost K r + 1 target passes: speedup = tokens / cost.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from specdecpp import SamplingConfig, load_pair, warp
from specdecpp.analysis.costmodel import Costs, fixed_k_speedup, save_costs
from specdecpp.core.attention import decode_attention
from specdecpp.core.compat import cache_kwargs
from specdecpp.core.timing import time_forwards
from specdecpp.data.prompts import encode_prompt, load_prompts
from specdecpp.models.loading import dtype_name, load_model, resolve_dtype
from specdecpp.models.reduced_vocab import ReducedOutput, output_vocab_size

PAIR_DIR = Path(__file__).resolve().parents[1] / "conf" / "pair"

SAMPLING = SamplingConfig(temperature=1.0, top_k=50)


def sample_response(target, prompt_ids: list[int], max_new_tokens: int, eos_token_id, seed: int) -> torch.Tensor:
    """prompt + a response sampled from the target's warped distribution: LongTensor [1, L + n]."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids], device=target.device)
    with torch.no_grad():
        out = target(ids, use_cache=True)
        cache = out.past_key_values
        for _ in range(max_new_tokens):
            probs = warp(out.logits[:, -1].float(), SAMPLING).cpu()  # drawn on the CPU: one generator anywhere
            token = torch.multinomial(probs, 1, generator=generator).to(ids.device)
            ids = torch.cat([ids, token], dim=1)
            if eos_token_id is not None and token.item() == eos_token_id:
                break
            out = target(token, use_cache=True, **cache_kwargs(target, cache))
    return ids


def position_acceptance(draft, target, ids: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha_i = sum_v min(p_i(v), q_i(v)) at each response position i, and the target's mass
    p_i(S) on the draft's output set S (1 for a full-vocabulary draft)."""
    with torch.no_grad():
        p = warp(target(ids[:, :-1]).logits[0, prompt_len - 1:], SAMPLING)
        q = warp(draft(ids[:, :-1]).logits[0, prompt_len - 1:, : p.shape[-1]], SAMPLING)
    layer = draft.get_output_embeddings()
    covered = (p[:, layer.token_ids].sum(-1) if isinstance(layer, ReducedOutput)
               else torch.ones(p.shape[0], device=p.device))
    return torch.minimum(p, q).sum(-1), covered


def step_times(models: dict, context: torch.Tensor, steps: int, widths: dict[str, list[int]] | None = None
               ) -> dict[str, dict[int, float]]:
    """Median seconds of one cached forward of n tokens per model (n = 1 and ``widths[name]``),
    batch 1, through the decoding engine's own model call (``specdecpp.models.runner.ModelRunner.feed``: on a
    CPU it pads 2-3 tokens to 4, as decoding does), the cache rolled back after each (untimed);
    every (model, n) in turn in each step (``specdecpp.core.timing.time_forwards``), so machine load
    affects all alike."""
    from specdecpp.models.runner import ModelRunner

    widths = widths or {}
    calls, resets = {}, {}
    with torch.no_grad():
        for name, model in models.items():
            runner = ModelRunner(model, output_vocab_size(model), want_hidden=False)
            tail_len = max([9, *[w + 1 for ws in widths.values() for w in ws]])
            runner.feed(context[0, :-tail_len].to(model.device))
            length, tail = runner.length, context[0, -tail_len:].to(model.device)
            for n in [1, *[w for w in widths.get(name, []) if w != 1]]:
                calls[(name, n)] = (lambda r=runner, t=tail[:n], n=n: r.feed(t, n_logits=n))
                resets[(name, n)] = (lambda r=runner, length=length: r.rollback(length))
        with decode_attention(next(iter(models.values())).device):  # the kernels decoding uses
            timed = time_forwards(calls, repeats=steps, warmup=3, resets=resets)
    out: dict[str, dict[int, float]] = {}
    for (name, n), t in timed.items():
        out.setdefault(name, {})[n] = t.median
    return out


def batch_times(draft, target, context: list[int], sizes: list[int], widths: list[int], repeats: int
                ) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
    """t_draft(B) (one token per row) and t_target(B, n) (n tokens per row): medians of the batched
    engine's forwards (``specdecpp.decoders.batch.BatchRunner.feed``) after ``context`` cached in every row,
    the cache rolled back and compacted after each (untimed); every (model, B, n) in turn in each
    step (``specdecpp.core.timing.time_forwards``), so machine load affects all alike."""
    from specdecpp.decoders.batch import BatchRunner

    tail_len = max(widths) + 1
    if len(context) <= tail_len:
        raise ValueError(f"batch_times: a context of {len(context)} tokens is too short for widths up to {max(widths)}")
    calls, resets = {}, {}
    for name, model, ws in (("draft", draft, [1]), ("target", target, widths)):
        for b in sizes:
            runner = BatchRunner(model, output_vocab_size(model), want_hidden=False)
            with torch.no_grad():
                runner.add_rows([torch.tensor(context[:-tail_len], device=model.device)] * b)
            tail, length = torch.tensor(context[-tail_len:], device=model.device), runner.lengths[0]
            for n in ws:
                calls[(name, b, n)] = (lambda r=runner, t=tail[:n], b=b: r.feed([t] * b, n_logits=t.shape[0]))
                resets[(name, b, n)] = (lambda r=runner, length=length, b=b: (r.rollback([length] * b), r.compact()))
    with torch.no_grad(), decode_attention(target.device):  # the kernels decoding uses
        timed = time_forwards(calls, repeats=repeats, warmup=2, resets=resets)
    return ({b: timed[("draft", b, 1)].median for b in sizes},
            {b: {n: timed[("target", b, n)].median for n in widths} for b in sizes})


def measured_widths(max_width: int) -> list[int]:
    """The widths the cost curves are timed at: 1..8, then 12, 16, 24, 32, 48, 64, 96, ... up to
    ``max_width``."""
    out, n = list(range(1, min(max_width, 8) + 1)), 8
    while True:
        for m in (n * 3 // 2, n * 2):
            if m > max_width:
                return out
            out.append(m)
        n *= 2


def measure(draft_path: str, target_path: str, sources: list[str], limit: int, max_new_tokens: int,
            timing_steps: int, seed: int, dtype: str = "fast", compare_dtypes: tuple[str, ...] = (),
            device: str = "cpu", max_width: int = 8, batch_sizes: tuple[int, ...] = ()) -> dict:
    draft, target, tokenizer = load_pair(draft_path, target_path, device=device, dtype=dtype)
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
                              "acceptance_per_prompt_std": (torch.stack([a.mean() for a in alphas]).std().item()
                                                             if len(alphas) > 1 else float("nan"))}
    context = sample_response(target, encode_prompt(tokenizer, load_prompts(sources[0], "test", 1)[0].prompt),
                              64 + max(0, max_width - 8), None, seed)  # a mid-generation cache, 64 tokens in
    models = {"draft": draft, "target": target}
    others = {dtype_name(d) for d in (resolve_dtype(x, draft.device) for x in compare_dtypes)} - {dtype_name(target.dtype)}
    for name in sorted(others):  # the same pair at another precision, timed in the same loop
        models[f"draft@{name}"] = load_model(draft_path, str(target.device), name)
        models[f"target@{name}"] = load_model(target_path, str(target.device), name)
    widths = measured_widths(max_width)
    timed = step_times(models, context, timing_steps, {name: widths for name in models})
    times = {name: t[1] for name, t in timed.items()}
    compare = {name: {"draft_step_s": times[f"draft@{name}"], "target_step_s": times[f"target@{name}"],
                      "cost_ratio": times[f"draft@{name}"] / times[f"target@{name}"],
                      "target_by_width_s": timed[f"target@{name}"]} for name in sorted(others)}
    batched = {}
    if batch_sizes:  # t_draft(B), t_target(B, n) for batched decoding (generate_batch), in a loop of their own
        bw = [n for n in widths if n <= 21]
        by_draft, by_target = batch_times(draft, target, context[0].tolist(), sorted({1, *batch_sizes}), bw, timing_steps)
        batched = {"draft_by_batch_s": by_draft, "target_by_batch_s": by_target}
    ratio = times["draft"] / times["target"]
    overall = sum(s["acceptance"] * s["positions"] for s in per_source.values()) / sum(
        s["positions"] for s in per_source.values())
    speedups = {k: fixed_k_speedup(overall, ratio, k) for k in range(1, 21)}
    best_k = max(speedups, key=speedups.get)
    return {"draft": draft_path, "target": target_path, "dtype": dtype_name(target.dtype), "device": str(target.device),
            "compare_dtypes": compare, "sampling": SAMPLING.to_dict(),
            "max_new_tokens": max_new_tokens, "seed": seed, "threads": torch.get_num_threads(),
            "per_source": per_source, "acceptance": overall,
            "draft_step_s": times["draft"], "target_step_s": times["target"], "cost_ratio": ratio,
            "target_by_width_s": timed["target"], "draft_by_width_s": timed["draft"], "draft_output_vocab": output_vocab_info(draft),
            "fixed_k_speedup": speedups, "best_k": best_k, "best_fixed_k_speedup": speedups[best_k], **batched}


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
              "draft cost of n tokens at once (ms): " + ", ".join(
                  f"n={n}: {t * 1e3:.1f}" for n, t in sorted(result["draft_by_width_s"].items())),
              "Eq. 2.3 fixed-K speedup: " + ", ".join(f"K={k}: {result['fixed_k_speedup'][k]:.2f}x"
                                                      for k in (1, 2, 3, 4, 6, 8)),
              f"best K = {result['best_k']}: {result['best_fixed_k_speedup']:.2f}x over target-only"]
    for b, curve in sorted((result.get("target_by_batch_s") or {}).items()):
        lines.append(f"batch {b}: draft step {result['draft_by_batch_s'][b] * 1e3:.1f} ms; target, n tokens per row (ms): "
                     + ", ".join(f"n={n}: {t * 1e3:.1f}" for n, t in sorted(curve.items())))
    if result.get("dtype"):
        lines.insert(len(rows) + 2, f"precision: {result['dtype']}")
    for name, c in result.get("compare_dtypes", {}).items():
        lines.append(f"same loop, {name}: draft step {c['draft_step_s'] * 1e3:.1f} ms, target step "
                     f"{c['target_step_s'] * 1e3:.1f} ms, cost ratio {c['cost_ratio']:.3f}; target by width (ms): "
                     + ", ".join(f"n={n}: {t * 1e3:.1f}" for n, t in sorted(c["target_by_width_s"].items())))
    return "\n".join(lines)


def pair_costs(result: dict) -> Costs:
    """The cost model's view of a measurement: what ``--costs-out`` writes."""
    meta = {k: result[k] for k in ("draft", "target", "device", "dtype", "threads")}
    return Costs(result["draft_step_s"], result["target_step_s"], dict(result["target_by_width_s"]),
                 {**meta, "measured_by": "python -m infer.costs"},
                 draft_by_width=dict(result.get("draft_by_width_s") or {}) or None,
                 target_by_batch=result.get("target_by_batch_s"), draft_by_batch=result.get("draft_by_batch_s"))


def pair_config(name: str) -> dict:
    """conf/pair/<name>.yaml with its interpolations resolved (the demo pair's paths follow
    $SPECDECPP_CACHE, as in infer); unset (``???``) entries are left out."""
    path = PAIR_DIR / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in PAIR_DIR.glob("*.yaml"))
        raise ValueError(f"--pair {name!r}: no conf/pair/{name}.yaml; choose among {choices} or pass --draft and --target")
    cfg = OmegaConf.load(path)
    return {k: cfg[k] for k in cfg if not OmegaConf.is_missing(cfg, k)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m infer.costs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="demo", help="a conf/pair/ config naming the models, device and dtype "
                        "(default demo: materialise it with `make demo-pair`)")
    parser.add_argument("--draft", help="draft model (default: the pair config's)")
    parser.add_argument("--target", help="target model (default: the pair config's)")
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N (default: the pair config's)")
    parser.add_argument("--sources", nargs="+", default=["bundled", "humaneval"],
                        help="prompt sources, test split of each (default: bundled humaneval)")
    parser.add_argument("--limit", type=int, default=20, help="prompts per source")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--timing-steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-width", type=int, default=8, help="time both models' forwards over up to this many "
                        "tokens at once (default 8; token trees: e.g. 64)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[], metavar="B",
                        help="also time batched forwards at these batch sizes (t_draft(B), t_target(B, n) for "
                        "n <= 21; costs.json's draft_by_batch / target_by_batch: the batched Eq. 2.3 of "
                        "infer.report and scripts/bench_batch.py), e.g. 4 16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", help="precision of both models (default: the pair config's; the demo's is fast: "
                        "bf16 on CUDA and on CPUs with native bf16, else float32) | auto | float32 | bfloat16 | float16")
    parser.add_argument("--compare-dtype", nargs="*", default=[], metavar="DTYPE",
                        help="also time the pair at these precisions in the same loop (e.g. float32)")
    parser.add_argument("--out", type=Path, help="write everything measured as JSON here")
    parser.add_argument("--costs-out", type=Path, help="write the pair's costs.json here "
                        "(for python -m infer.potential --costs and python -m infer.report --costs)")
    args = parser.parse_args(argv)
    if args.out is None and args.costs_out is None:
        parser.error("nothing to write: pass --costs-out FILE (costs.json) and/or --out FILE (everything measured)")
    try:
        pair = {} if args.draft and args.target else pair_config(args.pair)
    except ValueError as exc:
        parser.error(str(exc))
    draft, target = args.draft or pair.get("draft"), args.target or pair.get("target")
    for name, ref in (("draft", draft), ("target", target)):
        if not ref:
            parser.error(f"--pair {args.pair} sets no {name} model: pass --{name} PATH")
        if str(ref).startswith((".", "/")) and not Path(ref).exists():
            parser.error(f"{name} model {str(ref)!r} does not exist (the demo pair: run `make demo-pair` first)")
    device = args.device or pair.get("device") or "cpu"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.max_width < 1:
        parser.error(f"--max-width must be >= 1, got {args.max_width}")
    if any(b < 1 for b in args.batch_sizes):
        parser.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    torch.set_num_threads(args.threads)
    result = measure(str(draft), str(target), args.sources, args.limit, args.max_new_tokens, args.timing_steps,
                     args.seed, args.dtype or pair.get("dtype") or "fast", tuple(args.compare_dtype), device,
                     args.max_width, tuple(args.batch_sizes))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.costs_out:
        save_costs(pair_costs(result), args.costs_out)
    print(table(result))
    print("\nwritten to " + ", ".join(str(p) for p in (args.out, args.costs_out) if p))


if __name__ == "__main__":
    main()
