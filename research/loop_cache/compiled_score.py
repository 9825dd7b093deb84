"""Experiment 11: a stop policy's per-candidate score, eager against one compiled call, cold.

The head's score (the lag-free head's features over the draft's logits row and its MLP) and SVIP's
entropy make some 15-40 torch calls per candidate between two forwards; experiment 7 says each pays
for a cache refill after the forward. Here each policy's ``should_stop`` is timed right after a
256 MB flush, as the engine calls it, against the same arithmetic compiled into one function
(``torch.compile(fullgraph=True)``) whose float64 result is read on the host. Random draft-shaped
inputs (the demo draft's hidden state and bf16 logits row), the demo draft's embedding and support.

    PYTHONPATH=. python research/loop_cache/compiled_score.py [--head demo/heads/next_wrej1_d1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specdecpp.stopping.head import load_head
from specdecpp.stopping.policies import SVIP, SpecDecPP, algorithm2_stops

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from demo_pair import demo_pair_bf16  # noqa: E402 (beside this file)
from loop_alone import median_us  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", default="demo/heads/next_wrej1_d1")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--flush-mb", type=int, default=256)
    args = ap.parse_args()
    draft, _, _ = demo_pair_bf16()
    vocab = draft.config.vocab_size
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(draft.config.hidden_size, generator=g).to(torch.bfloat16)
    logits = (3 * torch.randn(vocab, generator=g)).to(torch.bfloat16)
    token = torch.tensor(int(logits.float().argmax()))
    flush = np.ones(args.flush_mb * 2**18, np.float32)

    head_policy = SpecDecPP(load_head(args.head), 0.5, max_candidates=3)
    head_policy.bind(draft, 1.0)
    svip = SVIP(0.3, max_candidates=3)
    svip.bind(draft, 1.0)
    head = head_policy.head

    def head_eager():
        head_policy.begin_round(0)
        return head_policy.should_stop(1, logits, hidden, token)

    def svip_eager():
        return svip.should_stop(1, logits, hidden, token)

    def svip_batch_of_one():  # what should_stop ran before (its stop_rows on one row, then a read)
        return bool(svip.stop_rows(1, logits.unsqueeze(0), None, token.reshape(1), torch.ones(1, dtype=torch.bool))[0])

    def head_prob(hidden, logits, token):
        return torch.sigmoid(head.score(hidden.unsqueeze(0), logits.unsqueeze(0), token.reshape(1))).double()

    support = svip.support(logits.unsqueeze(0))

    def svip_stop(logits):
        from specdecpp.core.sampling import entropy
        h = entropy(logits.unsqueeze(0), 1.0, support).double()
        return svip.c * h > svip.threshold * svip.threshold

    compiled = {}
    for name, fn, inputs in (("head", head_prob, (hidden, logits, token)), ("svip", svip_stop, (logits,))):
        c = torch.compile(fn, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        out = c(*inputs)
        print(f"compiled {name} in {time.perf_counter() - t0:.1f} s")
        ref = fn(*inputs)
        assert torch.equal(out, ref) or torch.allclose(out.double(), ref.double(), rtol=1e-6), (name, out, ref)
        compiled[name] = (c, inputs)

    def head_compiled():
        c, inputs = compiled["head"]
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            p = float(c(*inputs)[0])
        return bool(algorithm2_stops(p, 1, 0.5, 1))

    def svip_compiled():
        c, inputs = compiled["svip"]
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return bool(c(*inputs)[0])

    assert head_eager() == head_compiled() and svip_eager() == svip_compiled()
    assert svip_eager() == svip_batch_of_one()
    cases = {"head eager": head_eager, "head compiled": head_compiled, "svip eager (one row)": svip_eager,
             "svip as a batch of one": svip_batch_of_one, "svip compiled": svip_compiled}
    print(f"| policy call | warm us | after a {args.flush_mb} MB flush us |")
    print("|---|---|---|")
    for _ in range(2):
        for name, fn in cases.items():
            print(f"| {name} | {median_us(fn, flush, args.repeats, False):.1f} | {median_us(fn, flush, args.repeats, True):.1f} |")


if __name__ == "__main__":
    main()
