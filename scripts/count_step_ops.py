"""How many operations a static step dispatches: about how many kernels a CUDA graph of it replays.

    python scripts/count_step_ops.py                 # the demo pair (make demo-pair)
    python scripts/count_step_ops.py --random        # the demo configs, random weights (no GGUF needed)
    python scripts/count_step_ops.py --draft D --target T --widths 1 4
    python scripts/count_step_ops.py --configs DIR   # DIR/draft.json, DIR/target.json, random weights

A ``fast="graphs"`` forward replays the eager static step's kernels one after another. On a GPU a
small model's forward is then bound by their number, not by its weights: on an H100 the demo
target's graphs forward took 3.4 ms for weights that read in 0.09 ms (docs/results/gpu.md). This
counts, on any device (a CPU will do), the ATen operations one feed of the static runner dispatches
(``fast="static"``: the same step that ``"graphs"`` captures, ``specdecpp.fast.step.static_step``,
and its staging), through a ``TorchDispatchMode``. It splits them into those that only make a new
view of a tensor (no kernel) and those that launch work. On CUDA each operation that launches work
is one kernel or a few: a GEMM may launch a split-K pair, and attention runs flash or
memory-efficient kernels where the CPU has its own. So the count is a floor-level estimate of the
graph's kernels, and the ms per kernel of a measured replay follows from it. Prints one table per
model and width; ``--out`` writes JSON.

``--loop`` counts instead what a chain round dispatches outside the forwards on the CUDA path, for K
= 0 (target-only), 1 and 3, greedy and sampled (temperature 1, top-k 50), over random bf16 logits (a
bf16 model's on CUDA) of 4,096 tokens (below ``TOP_K_MIN_VOCAB``, so that a CPU takes the dense ways
CUDA takes; the count does not depend on the vocabulary): the drafter's draws (the argmax, or
``warp`` and an unchecked ``sample``) and their
writes to the token buffer, the exact rule's CUDA branch (``warp`` of the K + 1 target rows, the draft
rows stacked, ``verify`` drawing the next token's candidate rows and reading them with its verdict and
the drafts), and the commit
(:meth:`~specdecpp.decoders.rounds.TokenBuffer.commit`, given the drafts read). On a CPU the engine
takes other ways for the same verdicts (rows kept sparse, one row at a time), so these calls are
made here as the CUDA branch makes them (``specdecpp.decoders.rounds.ExactRule``, ``Drafter.block``).

``--captured`` counts what a captured round graph (specdecpp/decoders/captured.py) holds outside its
forwards: fixed K's whole round (K = 0, 1, 3) and SVIP's candidate graphs with its verdict graph (K =
1, 3), greedy and sampled, run eagerly over two small random bf16 Llamas of 4,096 tokens with the
forwards' own operations (their staging included) left out. On CUDA these are the kernels a replay
runs beyond its forwards, which ``scripts/bench_fast.py --round-graphs`` times.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdecpp.fast.buckets import fit_buckets
from specdecpp.fast.runners import StaticRunner

# operations that return a view or alias of their input: no kernel is launched
VIEWS = frozenset({"view", "t", "_unsafe_view", "slice", "transpose", "unsqueeze", "squeeze", "expand", "select",
                   "as_strided", "reshape", "_reshape_alias", "permute", "alias", "detach", "unbind", "split",
                   "split_with_sizes", "chunk", "narrow", "view_as_real", "view_as_complex",
                   "lift_fresh"})  # lift_fresh: a constant tensor marked as an input, returned as it is


class OpCounter(TorchDispatchMode):
    """Counts every ATen operation dispatched inside it, by name (overload packet), except while
    ``paused`` (:meth:`uncounted`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def uncounted(self, fn):
        """``fn`` with the count paused while it runs."""
        def run(*args, **kwargs):
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False
        return run


def count_feed(model, width: int, context: int = 16) -> collections.Counter:
    """The operations of one static-runner feed of ``width`` tokens after ``context`` cached ones."""
    runner = StaticRunner(model, model.config.vocab_size, want_hidden=True, fast="static",
                          max_len=context + 64, buckets=(width,))
    device = next(model.parameters()).device
    with torch.no_grad():
        runner.feed(torch.arange(context, device=device) % model.config.vocab_size)
        with OpCounter() as counter:
            runner.feed(torch.arange(width, device=device))
    return counter.counts


LOOP_SAMPLINGS = {"greedy": dict(temperature=0), "sampled": dict(temperature=1.0, top_k=50)}


def count_round_loop(k: int, sampling: str, vocab: int, seed: int = 0) -> collections.Counter:
    """The operations of one chain round's loop on the CUDA path (module docstring, ``--loop``)."""
    from specdecpp.core.sampling import SamplingConfig, argmax, dense_rows, sample, warp
    from specdecpp.core.verify import verify
    from specdecpp.decoders.rounds import Candidates, TokenBuffer

    cfg = SamplingConfig(**LOOP_SAMPLINGS[sampling])
    g = torch.Generator().manual_seed(seed)
    draft_logits, target_logits = (torch.randn(n, vocab, generator=g).to(torch.bfloat16) for n in (k, k + 1))
    seq = TokenBuffer(torch.tensor([[1, 2, 3]]), 16, None, torch.device("cpu"))
    with OpCounter() as counter:
        q = []
        for i in range(k):  # Drafter.block off a CPU: no read
            if cfg.greedy:
                y = argmax(draft_logits[i])
            else:
                q.append(warp(draft_logits[i], cfg))
                y = sample(q[-1], g, check=False)
            seq.tokens[seq.n + i] = y
        drafted = Candidates(seq.tokens[seq.n : seq.n + k], q, read=[])
        if cfg.greedy:  # ExactRule off a CPU
            n, token = verify(drafted.tokens, None, target_logits, greedy=True, drafts_out=drafted.read)
        else:
            p = warp(target_logits, cfg)
            rows = torch.stack(dense_rows(q)) if q else p.new_zeros((0, vocab))
            n, token = verify(drafted.tokens, rows, p, g, drafts_out=drafted.read if q else None)
        seq.commit(n, token, drafted.read)
    return counter.counts


CAPTURED_POLICIES = ("fixed", "svip")


def count_captured_round(k: int, sampling: str, vocab: int, policy: str = "fixed",
                         seed: int = 0) -> collections.Counter:
    """The operations a captured round holds outside its forwards (module docstring, ``--captured``):
    ``policy="fixed"``: :class:`~specdecpp.decoders.captured.RoundGraph`'s whole round of K candidates
    (K = 0: target-only); ``"svip"``: :class:`~specdecpp.decoders.captured.StepGraphs`' K candidate
    graphs of SVIP and its verdict graph for K. Run eagerly (what a capture records) over two small
    random bf16 Llamas with ``vocab`` tokens (bf16 logits take torch's argmax on a CPU too, as on
    CUDA; float32 ones would take numpy's), the forwards' own operations (their staging included)
    not counted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdecpp.core.sampling import SamplingConfig
    from specdecpp.decoders.captured import RoundGraph, StepGraphs
    from specdecpp.stopping.policies import SVIP

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    draft, target = (LlamaForCausalLM(cfg).to(torch.bfloat16).eval().requires_grad_(False) for _ in range(2))
    buckets = (1, 2, 4)
    runners = [StaticRunner(m, vocab, want_hidden=True, fast="static", max_len=64, buckets=buckets)
               for m in (draft, target)]
    sampling_cfg = SamplingConfig(**LOOP_SAMPLINGS[sampling])
    if policy == "fixed":
        graph = RoundGraph(*runners, k, sampling_cfg, vocab, fit_buckets(k + 1, buckets)[-1])
    else:
        graph = StepGraphs(*runners, SVIP(0.3, max_candidates=k), k, sampling_cfg, vocab, set())
    graph.n.fill_(8)
    graph.u.uniform_(generator=torch.Generator().manual_seed(seed))
    counter = OpCounter()
    graph.draft_forward = counter.uncounted(graph.draft_forward)
    graph.target_forward = counter.uncounted(graph.target_forward)
    with torch.no_grad(), counter:
        if policy == "fixed":
            graph._round()
        else:
            for i in range(k):
                graph._candidate_step(i)
            graph._verdict_step(k, None if graph.q is None else graph.q[:k])
    return counter.counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", help="draft model (default: the demo pair's)")
    ap.add_argument("--target", help="target model (default: the demo pair's)")
    ap.add_argument("--random", action="store_true", help="the demo configs with random weights")
    ap.add_argument("--configs", help="a folder with draft.json and target.json (Llama configs), random weights")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--loop", action="store_true", help="count a chain round's loop outside the forwards on the "
                    "CUDA path instead (module docstring)")
    ap.add_argument("--captured", action="store_true", help="count what a captured round graph holds outside its "
                    "forwards instead: fixed K (K = 0, 1, 3) and SVIP's step graphs (K = 1, 3) (module docstring)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.loop:
        return loop_table(args)
    if args.captured:
        return captured_table(args)
    from bench_fast import load  # scripts/ is on a script's path

    draft, target, _, pair = load(args, torch.device("cpu"))
    models = {"draft": draft, "target": target}
    print(f"{pair}; {args.dtype}; one static-runner feed after 16 cached tokens")
    result = {}
    print("| model | width | layers | operations | views (no kernel) | launching work | per layer | most frequent |")
    print("|---|---|---|---|---|---|---|---|")
    for role, model in models.items():
        layers = model.config.num_hidden_layers
        for width in args.widths:
            counts = count_feed(model, width)
            work = {k: v for k, v in counts.items() if k not in VIEWS}
            n_work, n_all = sum(work.values()), sum(counts.values())
            top = ", ".join(f"{k} {v}" for k, v in sorted(work.items(), key=lambda kv: -kv[1])[:8])
            print(f"| {role} | {width} | {layers} | {n_all} | {n_all - n_work} | {n_work} | {n_work / layers:.1f} | "
                  f"{top} |")
            result[f"{role}_w{width}"] = {"layers": layers, "operations": n_all, "launching": n_work,
                                          "by_name": dict(counts)}
    write_json(args.out, result)
    return 0


def summary(counts: collections.Counter) -> tuple[dict, str]:
    """``counts`` as a JSON record (all operations, those launching work, by name) and the table's
    cells: operations, views, launching work, the six most frequent that launch work."""
    work = {name: n for name, n in counts.items() if name not in VIEWS}
    n_work, n_all = sum(work.values()), sum(counts.values())
    top = ", ".join(f"{name} {n}" for name, n in sorted(work.items(), key=lambda kv: -kv[1])[:6])
    return ({"operations": n_all, "launching": n_work, "by_name": dict(counts)},
            f"{n_all} | {n_all - n_work} | {n_work} | {top} |")


def write_json(path: Path | None, result: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")


def loop_table(args) -> int:
    vocab = 4096  # below TOP_K_MIN_VOCAB: the dense ways (module docstring)
    print(f"a chain round's loop on the CUDA path, random bf16 logits over {vocab} tokens")
    print("| sampling | K | operations | views (no kernel) | launching work | most frequent |")
    print("|---|---|---|---|---|---|")
    result = {}
    for sampling in LOOP_SAMPLINGS:
        for k in (0, 1, 3):
            result[f"{sampling}_k{k}"], cells = summary(count_round_loop(k, sampling, vocab))
            print(f"| {sampling} | {k} | {cells}")
    write_json(args.out, result)
    return 0


def captured_table(args) -> int:
    vocab = 4096
    print(f"a captured round outside its forwards (specdecpp/decoders/captured.py), "
          f"random bf16 Llamas over {vocab} tokens")
    print("| round | sampling | K | operations | views (no kernel) | launching work | most frequent |")
    print("|---|---|---|---|---|---|---|")
    result = {}
    for policy in CAPTURED_POLICIES:
        for sampling in LOOP_SAMPLINGS:
            for k in (0, 1, 3) if policy == "fixed" else (1, 3):
                result[f"{policy}_{sampling}_k{k}"], cells = summary(count_captured_round(k, sampling, vocab, policy))
                label = "target-only" if policy == "fixed" and k == 0 else policy
                print(f"| {label} | {sampling} | {k} | {cells}")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
