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
--fast static|compile|graphs|compile-graphs: time the forwards on the fast path (docs/engine.md, "The fast
    path"): the static KV cache, each width padded to its bucket (1, 2, 4, ..., 32; wider ones run eager)
    and, with compile, each bucket compiled once before timing (with graphs, CUDA only: captured as a CUDA
    graph on its first, untimed, forward; compile-graphs: compiled, then captured); costs.json records it
    (provenance.fast).
    Batched curves (--batch-sizes) too: the static batch runner, B padded to its batch bucket (1, 2,
    4, 8, 16) and n to its width bucket, each (B, n) bucket compiled or captured on its first, untimed,
    forward.
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

from specdecpp.analysis.costmodel import save_costs

from .measure import MeasureConfig, measure, pair_costs
from .pairs import command_pair


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
    for source, by_depth in (result.get("acceptance_by_depth") or {}).items():  # a feature draft
        lines.append(f"feature draft, {source}: acceptance at depths 1..{len(by_depth)} of a round: "
                     + ", ".join(f"{a:.3f}" for a in by_depth) + " (the fixed-K line assumes depth 1's at every depth)")
    for b, curve in sorted((result.get("target_by_batch_s") or {}).items()):
        lines.append(f"batch {b}: draft step {result['draft_by_batch_s'][b] * 1e3:.1f} ms; "
                     "target, n tokens per row (ms): "
                     + ", ".join(f"n={n}: {t * 1e3:.1f}" for n, t in sorted(curve.items())))
    if result.get("dtype"):
        lines.insert(len(rows) + 2, f"precision: {result['dtype']}"
                     + (f", fast path: {result['fast']}" if result.get("fast") else ""))
    for name, c in result.get("compare_dtypes", {}).items():
        lines.append(f"same loop, {name}: draft step {c['draft_step_s'] * 1e3:.1f} ms, target step "
                     f"{c['target_step_s'] * 1e3:.1f} ms, cost ratio {c['cost_ratio']:.3f}; target by width (ms): "
                     + ", ".join(f"n={n}: {t * 1e3:.1f}" for n, t in sorted(c["target_by_width_s"].items())))
    return "\n".join(lines)


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
                        "bf16 on CUDA and on CPUs with native bf16, else float32) "
                        "| auto | float32 | bfloat16 | float16")
    parser.add_argument("--compare-dtype", nargs="*", default=[], metavar="DTYPE",
                        help="also time the pair at these precisions in the same loop (e.g. float32)")
    parser.add_argument("--fast", choices=["static", "compile", "graphs", "compile-graphs"],
                        help="time the forwards on the fast path (default: eager)")
    parser.add_argument("--out", type=Path, help="write everything measured as JSON here")
    parser.add_argument("--costs-out", type=Path, help="write the pair's costs.json here "
                        "(for python -m infer.potential --costs and python -m infer.report --costs)")
    args = parser.parse_args(argv)
    if args.out is None and args.costs_out is None:
        parser.error("nothing to write: pass --costs-out FILE (costs.json) and/or --out FILE (everything measured)")
    try:
        pair = command_pair(args.pair, args.draft, args.target, args.device, args.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    if args.max_width < 1:
        parser.error(f"--max-width must be >= 1, got {args.max_width}")
    if any(b < 1 for b in args.batch_sizes):
        parser.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    torch.set_num_threads(args.threads)
    config = MeasureConfig(sources=tuple(args.sources), limit=args.limit, max_new_tokens=args.max_new_tokens,
                           timing_steps=args.timing_steps, seed=args.seed, dtype=pair["dtype"],
                           compare_dtypes=tuple(args.compare_dtype), device=pair["device"], max_width=args.max_width,
                           batch_sizes=tuple(args.batch_sizes), fast=args.fast)
    result = measure(pair["draft"], pair["target"], config)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.costs_out:
        save_costs(pair_costs(result), args.costs_out)
    print(table(result))
    print("\nwritten to " + ", ".join(str(p) for p in (args.out, args.costs_out) if p))


if __name__ == "__main__":
    main()
