"""Experiment 13: a fixed-K round's whole draft phase as one compiled call, against the engine's.

README.md, "What is left", prices the design that would remove the per-candidate host cost: K
draft steps with a fixed-size sparse top-k and the inverse-CDF draw inside one compiled function,
the K uniforms handed in, and the host making one call and one read. This prototype builds that
function for the demo draft and times it against the engine's draft phase
(:meth:`specdecpp.decoders.rounds.Drafter.block` under ``FixedK(K)`` on a compiled
:class:`~specdecpp.models.static.StaticRunner`), both right after a 256 MB flush (a target
forward's size) and warm, call by call in a shuffled order, ``--repeats`` calls each. Both sides
include their K draft forwards. The difference is host time a round would save. The draft's
one-token step alone (the engine's compiled step, called the engine's way) and the same graph
without its draws (its K forwards alone) are timed too, so that each side's time outside its
forwards can be read off.

The prototype's draw takes the top 64 of the row, either by ``topk`` over the whole row or by
chunk maxima first (two graphs). It keeps top-k 50 with its ties where they fit, takes the softmax
of the kept logits and draws by inverse CDF in decreasing-logit order, and it flags a row whose ties
spill past 64. It is meant to have the engine's distribution with other tokens for the same
uniforms, but as a timing prototype it is not tested for that. It feeds
the draft nothing but its own candidates. It is not a decoder: it does not verify or commit.

    SPECDECPP_CACHE=.cache PYTHONPATH=. python research/loop_cache/compiled_draft.py [--k 3] [--repeats 150]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from demo_pair import demo_pair_bf16  # beside this file: the study's shared setting

from specdecpp.core.sampling import SamplingConfig
from specdecpp.core.timing import Clock
from specdecpp.decoders.rounds import Drafter
from specdecpp.models import static
from specdecpp.stopping.policies import FixedK

KEEP = 64  # the fixed-size candidate set inside the compiled call
CHUNK = 64  # logits per chunk where the top-k narrows the row by chunk maxima first


def top_kept(row: torch.Tensor, chunks: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The KEEP largest logits of ``row`` [V] (float32) and their ids, and the smallest value a
    logit left out may have (to flag ties that spill): ``topk`` over the whole row, or (``chunks``)
    over the maxima of chunks of CHUNK logits first, then over the KEEP best chunks' logits, as the
    engine's CPU path narrows its rows (specdecpp.core.sampling, TOP_K_CHUNK)."""
    if not chunks:
        values, ids = row.topk(KEEP + 1)
        return values[:KEEP], ids[:KEEP], values[KEEP]
    grid = row.view(-1, CHUNK)
    best, which = grid.amax(1).topk(KEEP + 1)  # a chunk outside the first KEEP holds nothing above best[KEEP]
    values, j = grid.index_select(0, which[:KEEP]).reshape(-1).topk(KEEP + 1)
    ids = which[:KEEP][j // CHUNK] * CHUNK + j % CHUNK
    return values[:KEEP], ids[:KEEP], torch.maximum(values[KEEP], best[KEEP])


def draft_phase_fn(runner: static.StaticRunner, k: int, top_k: int, draw: bool = True, chunks: bool = False):
    """The K draft steps and draws as one function of (the last committed token [1], its slot
    start (0-d), K uniforms) -> (the K candidates [K], whether any row's ties spilled past KEEP).
    ``draw=False``: the same K steps, each fed the token it was given and nothing drawn, with the
    K logits rows returned as a third output (the forwards' own cost inside such a graph: an
    output no one reads would let inductor drop each step's output layer)."""
    fixed = (runner.decoder, runner.head, runner.cache_arg, runner.cache)
    causal = runner.causal_mask()

    def phase(token: torch.Tensor, start: torch.Tensor, u: torch.Tensor):
        out, rows, spilled = [], [], torch.zeros((), dtype=torch.bool)
        for i in range(k):
            slots = start + i + torch.arange(1)
            positions = start + i + torch.arange(1)
            logits, _ = static.static_step(*fixed, token, positions, slots, causal.index_select(0, slots)[None, None])
            if not draw:  # the next step is fed the same token again; each row is returned, so that
                out.append(token)  # no step's output layer is left out of the graph
                rows.append(logits[0])
                continue
            values, ids, next_best = top_kept(logits[0].float(), chunks)
            kth = values[top_k - 1]
            spilled = spilled | (next_best >= kth)
            probs = torch.softmax(values.masked_fill(values < kth, float("-inf")), dim=-1)
            cdf = probs.cumsum(0)
            j = torch.searchsorted(cdf, (u[i] * cdf[-1]).reshape(1)).clamp_max(KEEP - 1)
            token = ids[j]
            out.append(token)
        return (torch.cat(out), spilled) if draw else (torch.cat(out), spilled, torch.stack(rows))

    return phase


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=150)
    ap.add_argument("--flush-mb", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=48)
    args = ap.parse_args()
    draft, target, _ = demo_pair_bf16()
    vocab = target.config.vocab_size
    sampling = SamplingConfig(temperature=1.0, top_k=50)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (args.prompt_len,), generator=g)
    flush = np.ones(args.flush_mb * 2**18, np.float32)
    p = args.prompt_len

    # the engine's way: Drafter.block under FixedK(K) on a compiled runner (the draft's buckets)
    engine = static.StaticRunner(draft, vocab, False, fast="compile", max_len=256, buckets=static.DRAFT_BUCKETS)
    drafter = Drafter(draft, vocab, FixedK(args.k), sampling, set(), Clock(torch.device("cpu")),
                      runners=lambda *a: engine)
    seq = torch.cat([prompt, torch.zeros(args.k + 1, dtype=torch.long)])
    engine.feed(prompt[:-1])
    t0 = time.perf_counter()

    def engine_phase():
        engine.rollback(p - 1)
        return drafter.block(seq, p, args.k, g).k

    def engine_step():  # one compiled one-token step, fed as the engine feeds it
        engine.rollback(p - 1)
        return engine.feed(prompt[-1:])[0]

    engine_phase(), engine_phase()
    print(f"engine's steps compiled in {time.perf_counter() - t0:.0f} s")

    # the design: one compiled call, under the same inductor options as the engine's width-1 step
    mine = static.StaticRunner(draft, vocab, False, fast="static", max_len=256, buckets=static.DRAFT_BUCKETS)
    mine.feed(prompt[:-1])
    options = static.narrow_options(static.COMPILE_OPTIONS["cpu"], 1)
    token, start = prompt[-1:].clone(), torch.tensor(p - 1)
    import torch._inductor.config as inductor_config

    calls = []
    for draw, chunks in ((True, False), (True, True), (False, False)):
        compiled = torch.compile(draft_phase_fn(mine, args.k, sampling.top_k, draw, chunks), fullgraph=True,
                                 dynamic=False, options=options)
        t0 = time.perf_counter()
        with inductor_config.patch(freezing=True), static.quiet_autotuning(options), mine.attention():
            compiled(token, start, torch.rand(args.k, generator=g))
        print(f"the draft phase (draws: {draw}, chunks: {chunks}) compiled in {time.perf_counter() - t0:.0f} s")
        stance = torch.compiler.set_stance(skip_guard_eval_unsafe=True)

        def one_call(compiled=compiled, stance=stance):
            with stance, mine.attention():
                ids, spilled, *_ = compiled(token, start, torch.rand(args.k, generator=g))
            return ids.tolist(), bool(spilled)

        one_call()
        calls.append(one_call)
    cases = {f"engine: Drafter.block, FixedK({args.k})": engine_phase, "design: one compiled call and one read": calls[0],
             "design, its top-k by chunk maxima": calls[1], "engine: one draft step (feed)": engine_step,
             "design's graph without its draws": calls[2]}
    order = np.random.default_rng(0)
    for cold in (False, True):
        times = {name: [] for name in cases}
        for _ in range(args.repeats):  # call by call, in a shuffled order each time
            for name in order.permutation(list(cases)):
                if cold:
                    flush.sum()
                t0 = time.perf_counter()
                cases[name]()
                times[name].append(time.perf_counter() - t0)
        label = f"after a {args.flush_mb} MB flush" if cold else "warm"
        print(f"\n{label}, {args.repeats} calls each, interleaved")
        print("| call | median us | quartiles us |")
        print("|---|---|---|")
        for name, ts in times.items():
            q1, q2, q3 = 1e6 * np.percentile(ts, [25, 50, 75])
            print(f"| {name} | {q2:.0f} | {q1:.0f}-{q3:.0f} |")
        a = np.array(times[list(cases)[0]])
        for name in list(cases)[1:3]:
            diff = a - np.array(times[name])  # paired: the same iteration
            print(f"engine - {name}, paired per iteration: median {1e6 * np.median(diff):.0f} us, "
                  f"quartiles {1e6 * np.percentile(diff, 25):.0f} to {1e6 * np.percentile(diff, 75):.0f} us")

if __name__ == "__main__":
    main()
