"""The study's negative experiment (README.md, "A forward thread on the other core"): every forward
step of the static runners runs on one worker thread pinned to CPU 1 while the loop stays on CPU 0,
so the loop's core keeps its private caches while the forward streams the weights through the
other's. Interleaved with the plain path, same seeds, the demo pair (make demo-pair), compiled:

    SPECDECPP_CACHE=.cache python research/loop_cache/forward_thread.py fixed_k3,svip,head,target_only 4

Prints per method: wall time, ms per round, the time outside the steps (the step timed inside the
worker, so the hand-off counts as outside) and whether the tokens are the same. Needs 2 CPUs.
A prototype, monkeypatched onto specdecpp.models.static.StaticRunner._step; not a product feature.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_fast import SAMPLINGS, methods, prompts  # noqa: E402

from specdecpp.decoders.chain import SpeculativeDecoder  # noqa: E402
from specdecpp.models import static  # noqa: E402
from specdecpp.models.loading import eos_token_ids, load_pair  # noqa: E402


class ForwardThread:
    """One worker thread pinned to ``cpus`` that runs the calls handed to it; the caller is pinned
    to ``loop_cpus`` and waits on a queue (the GIL released) while the worker runs."""

    def __init__(self, cpus: set[int], loop_cpus: set[int]) -> None:
        self.requests, self.replies, self.inside = queue.SimpleQueue(), queue.SimpleQueue(), 0.0

        def work() -> None:
            os.sched_setaffinity(0, cpus)
            while True:
                fn, args = self.requests.get()
                try:
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out = fn(*args)
                    self.inside += time.perf_counter() - t0
                    self.replies.put((True, out))
                except BaseException as e:  # noqa: BLE001 (handed back to the caller)
                    self.replies.put((False, e))

        threading.Thread(target=work, daemon=True, name="forward").start()
        os.sched_setaffinity(0, loop_cpus)

    def call(self, fn, *args):
        self.requests.put((fn, args))
        ok, out = self.replies.get()
        if not ok:
            raise out
        return out


def main() -> None:
    names, n = sys.argv[1].split(","), int(sys.argv[2])
    torch.set_num_threads(1)
    draft, target, tok = load_pair(".cache/demo/draft", ".cache/demo/target", device="cpu", dtype="fast")
    args = argparse.Namespace(head="demo/heads/next_wrej1_d1", head_threshold=0.5, head_max=8, svip_threshold=0.3,
                              svip_max=8, prompts=n, seed=0)
    ids, eos = prompts(args, tok, target.config.vocab_size, torch.device("cpu")), eos_token_ids(tok, draft, target)
    worker, use, inside = ForwardThread({1}, {0}), [False], [0.0]
    plain = static.StaticRunner._step

    def _step(self, width):
        fn = plain(self, width)
        if use[0]:
            return lambda *a: worker.call(fn, *a)

        def timed(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            inside[0] += time.perf_counter() - t0
            return out

        return timed

    static.StaticRunner._step = _step
    decoders = {name: SpeculativeDecoder(draft, target, methods(args, draft)[name], SAMPLINGS["paper"], fast="compile")
                for name in names}
    for d in decoders.values():
        d.warm_up(max(p.shape[1] for p in ids), 64)
        for u in (False, True):
            use[0] = u
            d.generate(ids[0], 8, torch.Generator().manual_seed(0), eos_token_id=eos)
    res: dict = {}
    for i, p in enumerate(ids):
        for name, d in decoders.items():
            for u in ((False, True) if i % 2 == 0 else (True, False)):
                use[0], inside[0], worker.inside = u, 0.0, 0.0
                t0 = time.perf_counter()
                out = d.generate(p, 64, torch.Generator().manual_seed(0), eos_token_id=eos)
                wall = time.perf_counter() - t0
                res.setdefault((name, u), []).append((wall, worker.inside if u else inside[0],
                                                      len(out.stats.accept_lengths), out.tokens[0].tolist()))
    for name in names:
        a, b = res[(name, False)], res[(name, True)]
        same = all(x[3] == y[3] for x, y in zip(a, b, strict=True))
        for label, rows in (("main", a), ("worker", b)):
            wall, fwd, r = (sum(x[j] for x in rows) for j in range(3))
            print(f"{name:11s} {label:6s} wall {wall:.2f}s  ms/round {1e3 * wall / r:.2f}  outside "
                  f"{1e3 * (wall - fwd) / r:.3f} ms ({100 * (wall - fwd) / wall:.1f}%)  same tokens={same}")
        ratio = [x[0] / y[0] for x, y in zip(a, b, strict=True)]
        print(f"   plain / worker wall per prompt: {np.round(ratio, 3).tolist()}  mean {np.mean(ratio):.3f}")


if __name__ == "__main__":
    main()
