"""How many operations a static step dispatches: about how many kernels a CUDA graph of it replays.

    python scripts/count_step_ops.py                 # the demo pair (make demo-pair)
    python scripts/count_step_ops.py --random        # the demo configs, random weights (no GGUF needed)
    python scripts/count_step_ops.py --draft D --target T --widths 1 4
    python scripts/count_step_ops.py --configs DIR   # DIR/draft.json, DIR/target.json, random weights

A ``fast="graphs"`` forward replays the eager static step's kernels one after another. On a GPU a
small model's forward is then bound by their number, not by its weights: on an H100 the demo
target's graphs forward took 3.4 ms for weights that read in 0.09 ms (docs/results/gpu.md). This
counts, on any device (a CPU will do), the ATen operations one feed of the static runner dispatches
(``fast="static"``: the same step that ``"graphs"`` captures, ``specdecpp.models.static.static_step``,
and its staging), through a ``TorchDispatchMode``. It splits them into those that only make a new
view of a tensor (no kernel) and those that launch work. On CUDA each operation that launches work
is one kernel or a few: a GEMM may launch a split-K pair, and attention runs flash or
memory-efficient kernels where the CPU has its own. So the count is a floor-level estimate of the
graph's kernels, and the ms per kernel of a measured replay follows from it. Prints one table per
model and width; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdecpp.models.static import StaticRunner

# operations that return a view or alias of their input: no kernel is launched
VIEWS = frozenset({"view", "t", "_unsafe_view", "slice", "transpose", "unsqueeze", "squeeze", "expand", "select",
                   "as_strided", "reshape", "_reshape_alias", "permute", "alias", "detach", "unbind", "split",
                   "split_with_sizes", "chunk", "narrow", "view_as_real", "view_as_complex"})


class OpCounter(TorchDispatchMode):
    """Counts every ATen operation dispatched inside it, by name (overload packet)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", help="draft model (default: the demo pair's)")
    ap.add_argument("--target", help="target model (default: the demo pair's)")
    ap.add_argument("--random", action="store_true", help="the demo configs with random weights")
    ap.add_argument("--configs", help="a folder with draft.json and target.json (Llama configs), random weights")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
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
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
