"""Measured tokens/s of batched decoding, B = 1, 4, 16: target-only, fixed K and SpecDec++ with
per-row stopping (the best reference head of each kind), in one interleaved run with intervals,
beside Eq. 2.1/2.3 generalised to batches with the measured t_draft(B) and t_target(B, n).

    python scripts/bench_batch.py                        # the demo pair, 8 bundled + 8 HumanEval test prompts
    python scripts/bench_batch.py --repeats 2 --max-new-tokens 32 --out reports/batch/bench.json

Every prompt set is split into batches of B prompts (16 prompts: 16 calls at B = 1, 4 at B = 4, 1
at B = 16); one unit is one ``generate_batch`` call, decoded by every method in turn (rotated) before
the next unit, so load drift on a shared machine touches all methods alike. Row b is seeded from
its prompt id (infer.results.prompt_seed), the same in every method and batch size. Printed per B
and method: pooled tokens/s (all tokens / all wall time), the speedup over target-only at the same
B with a paired 95% bootstrap interval over units (specdecpp.analysis.stats), and the prediction from the
calls' recorded rounds (specdecpp.analysis.costmodel.batch_latency) with costs measured first in the same
process (t_draft(B) and t_target(B, n) by timing BatchRunner forwards on a real prompt's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from infer.measure import batch_times
from infer.results import prompt_seed
from specdecpp import (
    FixedK,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
    TargetOnly,
    load_head,
    load_pair,
)
from specdecpp.analysis.costmodel import Costs, batch_latency
from specdecpp.analysis.stats import paired_ratio_interval
from specdecpp.core.timing import machine_description
from specdecpp.data.prompts import encode_prompt, load_prompts
from specdecpp.models.loading import dtype_name, eos_token_ids

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = SamplingConfig(temperature=1.0, top_k=50)


def batch_costs(draft, target, context: list[int], sizes: list[int], widths: list[int], repeats: int) -> Costs:
    """t_draft(B) and t_target(B, n) as ``python -m infer.costs --batch-sizes`` measures them."""
    draft_by_batch, target_by_batch = batch_times(draft, target, context, sizes, widths, repeats)
    return Costs(draft_by_batch[1], target_by_batch[1][1], dict(target_by_batch[1]),
                 {"measured_by": "scripts/bench_batch.py"}, target_by_batch=target_by_batch,
                 draft_by_batch=draft_by_batch)


def plot(table: list[dict], path: Path, title: str) -> Path:
    """Speedup over target-only at the same batch size, per method, against B (log axis), with the
    95% intervals as error bars, beside the Eq. 2.1 prediction (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, m in enumerate(dict.fromkeys(r["method"] for r in table if r["method"] != "target_only")):
        rs = sorted((r for r in table if r["method"] == m), key=lambda r: r["batch_size"])
        bs = [r["batch_size"] * (1 + 0.03 * (i - 2)) for r in rs]  # small offsets keep the bars apart
        lo = [r["speedup"] - (r["speedup_ci95"][0] if r["speedup_ci95"][0] is not None else r["speedup"]) for r in rs]
        hi = [(r["speedup_ci95"][1] if r["speedup_ci95"][1] is not None else r["speedup"]) - r["speedup"] for r in rs]
        line = ax.errorbar(bs, [r["speedup"] for r in rs], yerr=[lo, hi], marker="o", capsize=3, label=m)
        ax.plot(bs, [r["predicted_speedup"] for r in rs], linestyle="--", color=line[0].get_color(), alpha=0.6)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (rows decoded at once)")
    ax.set_ylabel("tokens/s over target-only at the same B")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def best_heads() -> dict[str, tuple[str, float]]:
    """The best reference head of each kind and its threshold (demo/heads/selection.json)."""
    ranking = json.loads((ROOT / "demo/heads/selection.json").read_text())["ranking"]
    out = {}
    for entry in ranking:  # best first within each kind
        out.setdefault(entry["kind"], (entry["name"], entry["best_threshold"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="demo")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per set (bundled test, HumanEval test)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--fixed-k", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--fill", action="store_true",
                    help="also run each head with generate_batch(fill=True) (rows that stopped draft on while "
                         "another row drafts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts")
    ap.add_argument("--timing-steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="auto", help="auto (CUDA where present) | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="fast")
    ap.add_argument("--out", default="reports/batch/bench.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cache = os.environ.get("SPECDECPP_CACHE", ".cache")
    draft, target, tokenizer = load_pair(f"{cache}/{args.pair}/draft", f"{cache}/{args.pair}/target",
                                         device=args.device, dtype=args.dtype)
    eos = sorted(eos_token_ids(tokenizer, target))
    prompts = [q for source in ("bundled", "humaneval") for q in load_prompts(source, split="test", limit=args.prompts)]
    encoded = [(q.id, encode_prompt(tokenizer, q.prompt)) for q in prompts]
    if any(len(encoded) % b for b in args.batch_sizes):
        raise SystemExit(f"--batch-sizes must divide the {len(encoded)} prompts")

    heads = best_heads()
    methods = {"target_only": TargetOnly()}
    methods.update({f"fixed_k{k}": FixedK(k) for k in args.fixed_k})
    for kind, (name, threshold) in sorted(heads.items()):
        methods[f"specdecpp_{kind}({name}@{threshold:g})"] = SpecDecPP(load_head(ROOT / "demo/heads" / name),
                                                                      threshold=threshold)
    decoders = {m: SpeculativeDecoder(draft, target, p, SAMPLING) for m, p in methods.items()}
    fill = {m: False for m in decoders}
    if args.fill:
        for m in [m for m in decoders if m.startswith("specdecpp_")]:
            decoders[m + "+fill"], fill[m + "+fill"] = decoders[m], True

    widths = sorted({1, 2, 3, 4, 6, 9, 14, 21})
    sizes = sorted({1, 2, 4, 8, 16} | set(args.batch_sizes))
    t0 = time.perf_counter()
    costs = batch_costs(draft, target, max((ids for _, ids in encoded), key=len), sizes, widths, args.timing_steps)
    print(f"costs measured in {time.perf_counter() - t0:.0f} s: t_draft(B) "
          + ", ".join(f"{b}: {t * 1e3:.1f} ms" for b, t in costs.draft_by_batch.items()))
    for b, curve in costs.target_by_batch.items():
        print(f"  t_target({b}, n) ms: " + ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in curve.items()))

    decoders["target_only"].generate_batch([torch.tensor(encoded[0][1])], 8)  # warm-up, untimed
    units: dict[tuple[int, str], list[dict]] = {}
    # Resumable: each finished unit (rep, B, first prompt) of every method is checkpointed here; a
    # rerun with the same arguments skips the units already measured.
    partial = Path(args.out).with_suffix(".partial.json")
    done: dict[str, dict] = {}
    if partial.exists():
        saved = json.loads(partial.read_text())
        if saved["args"] == {k: v for k, v in vars(args).items() if k != "out"}:
            done = saved["units"]
            print(f"resuming: {len(done)} unit(s) already measured in {partial}")
    load_before = os.getloadavg()
    t_run = time.perf_counter()
    unit = 0
    for rep in range(args.repeats):
        for b in args.batch_sizes:
            for start in range(0, len(encoded), b):
                group = encoded[start: start + b]
                order = list(decoders)
                order = order[unit % len(order):] + order[: unit % len(order)]  # rotate who goes first
                unit += 1
                key = f"{rep}|{b}|{start}"
                if key in done:
                    for m, u in done[key].items():
                        units.setdefault((b, m), []).append(u)
                    continue
                measured = {}
                for m in order:
                    gens = [torch.Generator().manual_seed(prompt_seed(rep, pid)) for pid, _ in group]
                    t = time.perf_counter()
                    outs = decoders[m].generate_batch([torch.tensor(ids) for _, ids in group], args.max_new_tokens,
                                                      gens, eos_token_id=eos, fill=fill[m])
                    wall = time.perf_counter() - t
                    tokens = sum(o.stats.n_generated for o in outs)
                    stats = [o.stats for o in outs]
                    measured[m] = {
                        "tokens": tokens, "wall_s": wall, "predicted_s": batch_latency(costs, outs[0].batch_rounds),
                        "rounds": len(outs[0].batch_rounds),
                        "draft_calls": sum(s.n_draft_calls for s in stats),
                        "discarded": sum(s.n_discarded for s in stats),
                        "accepted": sum(sum(s.accept_lengths) for s in stats),
                        "candidates": sum(sum(s.candidate_lengths) for s in stats),
                        "batch_width_mean": float(np.mean([r[1] for r in outs[0].batch_rounds])),
                        "row_k_mean": float(np.mean([k for s in stats for k in s.candidate_lengths])),
                        "load": os.getloadavg()[0],
                    }
                for m in decoders:
                    units.setdefault((b, m), []).append(measured[m])
                done[key] = measured
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"},
                                               "units": done}) + "\n")
            print(f"rep {rep} B={b} done ({time.perf_counter() - t_run:.0f} s)", flush=True)

    table = []
    for b in args.batch_sizes:
        base = units[(b, "target_only")]
        for m in decoders:
            us = units[(b, m)]
            tok, wall, pred = (np.array([u[k] for u in us], dtype=float) for k in ("tokens", "wall_s", "predicted_s"))
            btok, bwall, bpred = (np.array([u[k] for u in base], dtype=float)
                                  for k in ("tokens", "wall_s", "predicted_s"))
            ci = (paired_ratio_interval(tok, wall, btok, bwall, n_resamples=2000)  # over units: needs two
                  if m != "target_only" and len(us) >= 2 else (None, None))
            table.append({
                "batch_size": b, "method": m, "units": len(us), "tokens": int(tok.sum()),
                "tokens_per_s": tok.sum() / wall.sum(),
                "speedup": (tok.sum() / wall.sum()) / (btok.sum() / bwall.sum()),
                "speedup_ci95": ci, "predicted_tokens_per_s": tok.sum() / pred.sum(),
                "predicted_speedup": (tok.sum() / pred.sum()) / (btok.sum() / bpred.sum()),
                "mean_row_k": float(np.mean([u["row_k_mean"] for u in us])),
                "mean_batch_k": float(np.mean([u["batch_width_mean"] for u in us])),
                "accepted_per_candidate": sum(u["accepted"] for u in us) / max(sum(u["candidates"] for u in us), 1),
                "discarded_per_token": sum(u["discarded"] for u in us) / tok.sum(),
            })
    machine = machine_description(target.device)
    print(f"\n{machine}, dtype "
          f"{dtype_name(target.dtype)}, {len(encoded)} prompts x {args.repeats} passes, {args.max_new_tokens} tokens, "
          f"T=1 top-k 50; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print("| B | method | tokens/s | speedup vs target-only (95% CI) | Eq. 2.1 predicted tok/s (speedup) "
          "| mean K per row | mean K_max per round | accepted / candidate |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        ci = f" [{r['speedup_ci95'][0]:.2f}, {r['speedup_ci95'][1]:.2f}]" if r["speedup_ci95"][0] is not None else ""
        print(f"| {r['batch_size']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.3f}{ci} | "
              f"{r['predicted_tokens_per_s']:.1f} ({r['predicted_speedup']:.3f}) | {r['mean_row_k']:.2f} | "
              f"{r['mean_batch_k']:.2f} | {r['accepted_per_candidate']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"table": table, "costs": costs.to_dict(),
                               "units": {f"{b}|{m}": u for (b, m), u in units.items()},
                               "args": vars(args), "threads": args.threads, "machine": machine,
                               "dtype": dtype_name(target.dtype),
                               "load_before": load_before, "load_after": os.getloadavg()},
                              indent=1, default=str) + "\n")
    png = plot(table, out.with_suffix(".png"), f"demo pair, {dtype_name(target.dtype)}, T=1 top-k 50; dashed: Eq. 2.1 "
               f"with t_draft(B), t_target(B, n)\n{machine}")
    print(f"written {out}, {png}")


if __name__ == "__main__":
    main()
