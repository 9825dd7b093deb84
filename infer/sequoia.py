"""python -m infer.sequoia measure | tree | check: Sequoia's acceptance vector, its tree, and whether
the tree delivers what the DP predicts.

    # 1. the acceptance vector p_1..p_W on held-out (dev) prompts, per sampling setting
    python -m infer.sequoia measure --pair demo --width 16 --temperature 1 --top-k 50 \
        --out reports/demo/acceptance__t1-k50-p1.json
    # 2. the tree: the bounded-depth DP over sizes the width curve was measured at (python -m
    #    infer.costs --max-width 64 --costs-out reports/demo/costs.json), priced by that curve
    python -m infer.sequoia tree --costs reports/demo/costs.json \
        --acceptance reports/demo/acceptance__t1-k50-p1.json --out reports/demo/tree__t1-k50-p1.json
    # 3. measured tokens per target call on the test prompts against the DP's G(n, d)
    python -m infer.sequoia check --pair demo --tree reports/demo/tree__t1-k50-p1.json

measure: decodes each prompt with a star of W children (specdecpp.SequoiaDecoder, TokenTree.star(W))
    and counts, per round, which child (1..W, in sampling order) was accepted or none: p_k is the
    share of rounds whose k-th child was accepted (rounds cut to no child by the length limit are
    left out), the estimate Sequoia's repo makes (methods/sequoia.md, "Estimating p").
tree: specdecpp.analysis.tree_search.choose_tree: the (n, d) with the largest G(n, d) * t_target(1) /
    (t_target(n) + the draft's forwards for that tree); writes the tree JSON (with the acceptance
    vector, G and the predicted speedup in it) and prints the table of candidates (best depth per size);
    --table FILE writes every candidate as JSON.
check: decodes the test prompts with a tree and prints measured tokens per target call beside the
    tree's expected tokens per round under the acceptance vector (Sequoia's F(T) = G(n, d) for the DP's tree).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from specdecpp import SamplingConfig, SequoiaDecoder, TokenTree, load_pair
from specdecpp.analysis.costmodel import load_costs
from specdecpp.analysis.tree_search import choose_tree
from specdecpp.data.prompts import encode_prompt, load_prompts
from specdecpp.models.loading import dtype_name, eos_token_ids

from .acceptance import SCHEMA, load_acceptance
from .pairs import command_pair
from .tags import sampling_tag


def decode(args, tree: TokenTree, split: str):
    """Decode ``args.limit`` prompts of each source's ``split`` with ``tree`` on ``args.models`` (the
    pair, :func:`infer.pairs.command_pair`); yields RunStats."""
    pair = args.models
    draft, target, tokenizer = load_pair(pair["draft"], pair["target"], device=pair["device"], dtype=pair["dtype"])
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    decoder = SequoiaDecoder(draft, target, tree, sampling)
    eos = eos_token_ids(tokenizer, target)
    meta = {"draft": pair["draft"], "target": pair["target"],
            "device": str(target.device), "dtype": dtype_name(target.dtype), "threads": torch.get_num_threads(),
            "sampling": sampling.to_dict(), "split": split, "sources": args.sources, "limit": args.limit,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed}
    prompts = [p for source in args.sources for p in load_prompts(source, split, args.limit)]
    for i, prompt in enumerate(tqdm(prompts, desc=f"sequoia {tree.size}-node tree on {split}", disable=args.quiet)):
        ids = torch.tensor([encode_prompt(tokenizer, prompt.prompt)], device=target.device)
        out = decoder.generate(ids, args.max_new_tokens, torch.Generator().manual_seed(args.seed + i), eos)
        yield meta, out.stats


def measure(args) -> dict:
    counts, rounds, meta = [0] * args.width, 0, {}
    for run_meta, stats in decode(args, TokenTree.star(args.width), args.split):
        meta = run_meta
        for tested, ranks in zip(stats.candidate_lengths, stats.accepted_ranks, strict=True):
            if tested == args.width:
                rounds += 1
                for k in ranks:
                    counts[k - 1] += 1
    if not rounds:
        raise SystemExit("measure: no round drafted all W children (raise --max-new-tokens)")
    p = [c / rounds for c in counts]
    return {"schema": SCHEMA, "acceptance": p, "none": 1 - sum(p), "rounds": rounds, "width": args.width,
            "counts": counts, **meta, "measured_by": "python -m infer.sequoia measure"}


def candidates_table(table) -> str:
    best = {}
    for c in table:  # best first: keep the first of each size
        best.setdefault(c.size, c)
    rows = ["| n | d | G(n, d) | t_target(n) ms | draft ms (widths) | predicted speedup |", "|---|---|---|---|---|---|"]
    rows += [f"| {c.size} | {c.depth} | {c.expected_tokens:.3f} | {c.target_s * 1e3:.1f} | {c.draft_s * 1e3:.1f} "
             f"({', '.join(map(str, c.draft_widths)) or '-'}) | {c.speedup:.3f} |" for c in sorted(best.values(),
                                                                                                  key=lambda c: c.size)]
    return "\n".join(rows)


def tree(args) -> None:
    try:
        acc = load_acceptance(args.acceptance)
        costs = load_costs(args.costs)
        chosen, table = choose_tree(acc["acceptance"], costs, args.sizes, args.max_depth)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"tree: {exc}") from None
    chosen.meta.update(sampling=acc.get("sampling"), acceptance_file=str(args.acceptance), costs_file=str(args.costs),
                       chosen_by="python -m infer.sequoia tree")
    chosen.save(args.out)
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(json.dumps([c.to_dict() for c in table], indent=1) + "\n")
    best = table[0]
    print(candidates_table(table))
    print(f"\nchosen: n={best.size}, d={best.depth}, G={best.expected_tokens:.3f} tokens per round, predicted "
          f"speedup {best.speedup:.3f}x over target-only ({costs.meta.get('device', '?')}, "
          f"{costs.meta.get('dtype', '?')}, {costs.meta.get('threads', '?')} threads); tree written to {args.out}")


def check(args) -> None:
    chosen = TokenTree.load(args.tree)
    p = chosen.meta.get("acceptance")
    generated = calls = 0
    for _, stats in decode(args, chosen, "test"):
        generated += stats.n_generated
        calls += stats.n_target_calls
    measured = generated / calls
    line = (f"tree n={chosen.size}, d={chosen.depth}: measured {measured:.3f} tokens per target call "
            f"({generated} tokens, {calls} calls)")
    if p:
        expected = chosen.expected_tokens(p)
        line += f"; DP's G = {expected:.3f} (measured / predicted = {measured / expected:.3f})"
    print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m infer.sequoia", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("measure", "check"):
        sp = sub.add_parser(name)
        sp.add_argument("--pair", default="demo")
        sp.add_argument("--draft")
        sp.add_argument("--target")
        sp.add_argument("--device")
        sp.add_argument("--dtype")
        sp.add_argument("--sources", nargs="+", default=["bundled"])
        sp.add_argument("--limit", type=int, default=8, help="prompts per source")
        sp.add_argument("--max-new-tokens", type=int, default=96)
        sp.add_argument("--temperature", type=float, default=1.0)
        sp.add_argument("--top-k", type=int, default=50)
        sp.add_argument("--top-p", type=float, default=1.0)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--threads", type=int, default=1)
        sp.add_argument("--quiet", action="store_true")
    m = sub.choices["measure"]
    m.add_argument("--width", type=int, default=16, help="children of the root (W)")
    m.add_argument("--split", default="dev", help="held-out prompts (default dev; the benchmark decodes test)")
    m.add_argument("--out", type=Path, required=True)
    c = sub.choices["check"]
    c.add_argument("--tree", type=Path, required=True)
    t = sub.add_parser("tree")
    t.add_argument("--costs", type=Path, required=True, help="costs.json with target_by_width and draft_by_width")
    t.add_argument("--acceptance", type=Path, required=True, help="python -m infer.sequoia measure's output")
    t.add_argument("--sizes", type=int, nargs="+", help="tree sizes n to weigh (default: the measured widths)")
    t.add_argument("--max-depth", type=int, default=12)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--table", type=Path, help="write every candidate as JSON here")
    args = parser.parse_args(argv)
    if args.command == "tree":
        tree(args)
        return
    if args.command == "measure" and args.width < 1:
        parser.error("--width must be >= 1")
    try:
        args.models = command_pair(args.pair, args.draft, args.target, args.device, args.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(args.threads)
    if args.command == "measure":
        result = measure(args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"acceptance vector over {result['rounds']} rounds "
              f"({sampling_tag(SamplingConfig.from_mapping(result['sampling']))}): "
              + ", ".join(f"p{k + 1}={x:.3f}" for k, x in enumerate(result["acceptance"]))
              + f"; none {result['none']:.3f}\nwritten to {args.out}")
    else:
        check(args)


if __name__ == "__main__":
    main()
