"""Would compiling a round's work between its forwards pay on a CPU? (research/loop_cache/README.md)

The sampled round's work outside the forwards (the draft's warp and draw per candidate, the target's
warp, the acceptance rule, the residual draw), written as the captured round writes it
(specdecpp/decoders/captured.py: dense top-k rows, uniforms given), timed eager and compiled
(``torch.compile(fullgraph=True)``, inductor's plain settings), warm and right after a numpy read of
``--flush-mb`` MB (a forward's weight stream). Both ways must give the same tokens.

    python research/loop_cache/compiled_glue.py --k 3 --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specdecpp.core.sampling import draw_with, rows_valid
from specdecpp.core.verify import acceptance_ratio, residual


def dense_warp(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """warp(logits, T=1, top-k) the dense way (specdecpp.core.sampling.warp, no sparse CPU path)."""
    logits = logits.float()
    kth = torch.topk(logits, top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


def candidate(row: torch.Tensor, u: torch.Tensor, top_k: int):
    q = dense_warp(row, top_k)
    return draw_with(q, u)[0].reshape(()), q


def verdict(logits: torch.Tensor, drafted: torch.Tensor, q_rows: torch.Tensor, u: torch.Tensor, top_k: int):
    k = drafted.shape[0]
    p = dense_warp(logits, top_k)
    ratio = acceptance_ratio(p[:k], q_rows, drafted)
    n_acc = (u[:k] < ratio).long().cumprod(0).sum()
    rows = torch.cat([residual(p[:k], q_rows), p[k:]])
    each, ok = draw_with(rows, u[k:])
    token = each.gather(0, n_acc.reshape(1))
    valid = ok.gather(0, n_acc.reshape(1))[0] & rows_valid(q_rows)
    return torch.cat([n_acc.reshape(1), valid.long().reshape(1), drafted, token])


def one_round(draft_rows, target_logits, u, top_k, cand, verd, flush=None):
    """The round's glue with each forward's output handed back (after a flush when given); seconds
    spent outside the flushes."""
    spent, drafts, qs = 0.0, [], []
    for i, row in enumerate(draft_rows):
        if flush is not None:
            flush()
            row.sum()  # the forward leaves its logits in cache
        t0 = time.perf_counter()
        y, q = cand(row, u[i : i + 1], top_k)
        drafts.append(y)
        qs.append(q)
        spent += time.perf_counter() - t0
    if flush is not None:
        flush()
        target_logits.sum()
    t0 = time.perf_counter()
    out = verd(target_logits, torch.stack(drafts), torch.stack(qs), u[len(draft_rows):], top_k).tolist()
    return spent + time.perf_counter() - t0, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--flush-mb", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    draft_rows = [torch.randn(args.vocab, generator=g).mul_(3).bfloat16() for _ in range(args.k)]
    target = torch.randn(args.k + 1, args.vocab, generator=g).mul_(3).bfloat16()
    for row in range(args.k):  # a target that agrees with the draft now and then
        target[row] = (draft_rows[row].float() + torch.randn(args.vocab, generator=g)).bfloat16()
    junk = np.ones(args.flush_mb * 2**20 // 8)

    def flush():
        junk.sum()

    ways = {"eager": (candidate, verdict)}
    t0 = time.perf_counter()
    ways["compiled"] = (torch.compile(candidate, fullgraph=True, dynamic=False),
                        torch.compile(verdict, fullgraph=True, dynamic=False))
    with torch.no_grad():
        u = torch.rand(2 * args.k + 1, generator=g, dtype=torch.float64)
        one_round(draft_rows, target, u, args.top_k, *ways["compiled"])
        print(f"compiled in {time.perf_counter() - t0:.1f} s")
        results = {name: {"warm": [], "cold": []} for name in ways}
        for r in range(args.repeats):
            u = torch.rand(2 * args.k + 1, generator=g, dtype=torch.float64)
            outs = {}
            for name, (cand, verd) in ways.items():  # interleaved: eager, compiled, each warm then cold
                for how in ("warm", "cold"):
                    seconds, outs[name, how] = one_round(draft_rows, target, u, args.top_k, cand, verd,
                                                         flush if how == "cold" else None)
                    results[name][how].append(seconds * 1e3)
            first = outs["eager", "warm"]
            if any(o != first for o in outs.values()):
                raise SystemExit(f"repeat {r}: the ways differ: {outs}")
    print(f"K={args.k}, vocab {args.vocab}, top-k {args.top_k}, 1 thread, {args.repeats} rounds, same output each way")
    print("| glue | warm ms/round | cold ms/round (after a flush per forward) |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {statistics.median(r['warm']):.3f} | {statistics.median(r['cold']):.3f} |")


if __name__ == "__main__":
    main()
