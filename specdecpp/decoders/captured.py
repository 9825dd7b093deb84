"""Captured rounds: a whole chain round of fixed K (or target-only) replayed as one CUDA graph.

Under ``fast="graphs"`` / ``"compile-graphs"`` each forward is a graph replay, but the rest of a
round (the draws, the acceptance rule, staging each forward's inputs, the commit) is some hundred
small kernels launched one by one from Python, which on an H100 took 17-42% of a fast round
(docs/results/gpu.md). Where nothing in a round depends on a value read on the host, the round can
be captured whole, as gpt-fast and vLLM capture a decoding step: under :class:`~specdecpp.stopping.
policies.FixedK` and :class:`~specdecpp.stopping.policies.TargetOnly` a round always drafts K
candidates, so the round is one graph, replayed once per round, and the host reads one small
tensor (the verdict, the drafts and the next token) after it. A :class:`SpeculativeDecoder` uses
it by default on the graph backends (``capture_rounds=False`` turns it off); adaptive policies
(SVIP, the heads) decide after each candidate on the host and keep the per-forward graphs.

What one round graph does, for committed tokens ``tokens[:n]`` with ``n`` a device scalar (both
caches hold ``tokens[:n - 1]``, the draft's last slot possibly not yet):

1. the draft feeds ``tokens[n - 2 : n]`` at slots ``n - 2, n - 1`` (slot ``n - 2`` again when the
   draft already holds it: the same token at the same position, so its KV is the same up to the
   rounding of another GEMM width, which changes q, never the exactness) and then each candidate
   at one slot, drawing ``y_i`` from ``q_i = warp(draft logits)`` (greedy: the argmax);
2. the target feeds ``tokens[n - 1 : n + K]`` (padded to its bucket) at slots ``n - 1 ..``;
3. the exact rule on the device: greedy, accept while ``y_i`` is the target's argmax; sampled,
   accept ``y_i`` while ``u_i < min(1, p_i(y_i) / q_i(y_i))``, then draw the next token from the
   residual of the first rejection or from p_{K+1} (core/verify.py, the same formulas);
4. the next token is written after the accepted ones, ``n`` advances, and
   ``[n_accepted, valid, y_1..y_K, token]`` is left in one output tensor.

Randomness: the 2K + 1 uniforms of a round (K draws, K tests, the next token's draw) are drawn
from the call's generator into the graph's input before each replay (one kernel), so the graph
holds no generator and the same seed gives the same output. They are other draws than the
uncaptured round's (which takes the next token's draw only after the verdict), so a captured and an
uncaptured call with one seed give different samples, each with the target's exact distribution
(tests/decoders/test_captured_rounds.py).

Where the round is not captured: the first round of a call (the prefill), a round with room for
fewer than K candidates (the end of a call), a call with logits hooks (transformers' processors),
``profile=True`` (the round's draft and target times cannot be split inside one graph), and cascades.

A round graph is captured once per process for a (draft buffers, target buffers, K, width,
sampling) and kept on the target's :class:`~specdecpp.models.static.GraphSet` with a token buffer and
the uniforms of its own (a call's :class:`~specdecpp.decoders.rounds.TokenBuffer` is bound to that
buffer); what a capture costs is counted in ``model_steps(target).capture_seconds`` under
``("round", K, width, size)``.
"""

from __future__ import annotations

import time

import torch

from ..core.sampling import INVALID_PROBS, SamplingConfig, argmax, draw_with, rows_valid, warp
from ..core.verify import acceptance_ratio, residual
from ..models import static
from ..models.static import GRAPH_BACKENDS, StaticRunner, model_steps
from ..stopping.policies import FixedK, TargetOnly
from .rounds import CallHooks, TokenBuffer


def round_candidates(policy, fast: str | None, capture: bool, cascade, profile: bool, hooks: CallHooks | None,
                     target_buckets: tuple[int, ...]) -> int | None:
    """The K of a call's captured rounds, or None where its rounds are not captured (module docstring)."""
    if not capture or fast not in GRAPH_BACKENDS or cascade is not None or profile:
        return None
    if not isinstance(policy, (FixedK, TargetOnly)):
        return None
    if hooks is not None and (hooks.draft_logits is not None or hooks.target_logits is not None):
        return None
    k = policy.max_candidates
    return k if k + 1 <= target_buckets[-1] else None


class RoundGraph:
    """One captured round (module docstring) over a draft and a target runner's buffers; built by
    :func:`round_graph`. ``bind(seq)`` points a call's token buffer at the graph's; ``run(seq, generator)``
    replays it and returns ``(n_accepted, token, drafts)`` after one host read."""

    def __init__(self, draft: StaticRunner, target: StaticRunner, k: int, sampling: SamplingConfig, vocab: int,
                 width: int) -> None:
        device = target.device
        self.k, self.sampling, self.vocab, self.width = k, sampling, vocab, width
        self.greedy = sampling.greedy
        self.tokens = torch.zeros(target.cache.size + 1, dtype=torch.long, device=device)
        self.n = torch.ones((), dtype=torch.long, device=device)
        self.n_host: int | None = None  # what self.n holds, as far as the host knows
        self.u = torch.zeros(2 * k + 1, dtype=torch.float64, device=device)
        self.pad = torch.arange(width, device=device).clamp_(max=k)  # the target's ids: tokens[n - 1 + pad]
        self.two = torch.arange(2, device=device)
        self.kk = torch.arange(k, device=device)
        self.draft_two = draft.forward_at(2) if k else None
        self.draft_one = draft.forward_at(1) if k > 1 else None
        self.target_fwd = target.forward_at(width)
        self.replay = self.out = None

    def _round(self) -> tuple[torch.Tensor]:
        k, n, cfg = self.k, self.n, self.sampling
        drafts, q_rows, checks = [], [], []
        for i in range(k):
            if i == 0:
                logits, _ = self.draft_two(self.tokens.index_select(0, n - 2 + self.two), n - 2)
                row = logits[1, : self.vocab]
            else:
                logits, _ = self.draft_one(drafts[-1].reshape(1), n + (i - 1))
                row = logits[0, : self.vocab]
            if self.greedy:
                y = argmax(row)
            else:
                q_i = warp(row, cfg)
                y, _ = draw_with(q_i, self.u[i : i + 1])
                q_rows.append(q_i)
            drafts.append(y.reshape(()))
        drafted = torch.stack(drafts) if k else self.kk
        if k:
            self.tokens.index_copy_(0, n + self.kk, drafted)
        logits, _ = self.target_fwd(self.tokens.index_select(0, n - 1 + self.pad), n - 1)
        logits = logits[: k + 1, : self.vocab]
        if self.greedy:
            top = argmax(logits)
            n_acc = (top[:k] == drafted).long().cumprod(0).sum() if k else torch.zeros_like(n)
            token = top.gather(0, n_acc.reshape(1))
            valid = torch.ones_like(n)
        else:
            p = warp(logits, cfg)
            rows = p
            if k:
                q = torch.stack(q_rows)
                ratio = acceptance_ratio(p[:k], q, drafted)
                n_acc = (self.u[k : 2 * k] < ratio).long().cumprod(0).sum()
                rows = torch.cat([residual(p[:k], q), p[k:]])
                checks.append(rows_valid(q))
            else:
                n_acc = torch.zeros_like(n)
            each, ok = draw_with(rows, self.u[2 * k :])
            token = each.gather(0, n_acc.reshape(1))
            valid = ok.gather(0, n_acc.reshape(1))[0]
            for c in checks:
                valid = valid & c
            valid = valid.long()
        self.tokens.index_copy_(0, (n + n_acc).reshape(1), token)
        self.n.add_(n_acc + 1)
        return (torch.cat([n_acc.reshape(1), valid.reshape(1), drafted, token]),)

    def forwards(self) -> tuple[torch.Tensor, ...]:
        """The round's forwards alone: the same widths, slots and buffers, each draft forward fed the
        token the buffer holds there, no draw, rule or write of ``n``. What a benchmark captures to
        time the round graph against (scripts/bench_fast.py ``--round-graphs``); its forwards write
        the caches above ``n`` only, which the next round writes again."""
        n, outs = self.n, []
        if self.k:
            outs.append(self.draft_two(self.tokens.index_select(0, n - 2 + self.two), n - 2)[0])
            for i in range(1, self.k):
                outs.append(self.draft_one(self.tokens.index_select(0, (n + (i - 1)).reshape(1)), n + (i - 1))[0])
        outs.append(self.target_fwd(self.tokens.index_select(0, n - 1 + self.pad), n - 1)[0])
        return tuple(outs)

    def capture(self, seq: TokenBuffer, pool) -> float:
        """Capture the round on ``seq``'s state (warm-ups run it for real, so ``n`` is put back
        after them; what they wrote above ``n`` the first replay writes again). Seconds it took."""
        t0 = time.perf_counter()
        self.n.fill_(seq.n)
        with torch.no_grad():
            self.replay, (self.out,) = static.capture_graph(self._round, pool)
        self.n.fill_(seq.n)
        self.n_host = seq.n
        return time.perf_counter() - t0

    def bind(self, seq: TokenBuffer) -> None:
        """Make ``seq`` keep its tokens in this graph's buffer (a view of it; the prompt copied over)."""
        size = seq.tokens.shape[0]
        if size > self.tokens.shape[0]:
            raise ValueError(f"a round graph holds {self.tokens.shape[0]} tokens; the call needs {size}")
        self.tokens[:size] = seq.tokens
        seq.tokens = self.tokens[:size]
        self.n_host = None

    def run(self, seq: TokenBuffer, generator: torch.Generator | None) -> tuple[int, int, list[int]]:
        if self.n_host != seq.n:
            self.n.fill_(seq.n)
        if not self.greedy:
            self.u.uniform_(generator=generator)
        self.replay()
        read = self.out.tolist()  # the round's one host read
        n_acc, valid, drafts, token = read[0], read[1], read[2 : 2 + self.k], read[2 + self.k]
        if not valid:
            raise ValueError(INVALID_PROBS)
        self.n_host = seq.n + n_acc + 1
        return n_acc, token, drafts


def replayable(seq: TokenBuffer, k: int, draft, target) -> bool:
    """Whether ``seq``'s next round can be a replay: K candidates fit, the target holds ``tokens[:n -
    1]`` and the draft at least ``tokens[:n - 2]`` (not so before the prefill)."""
    n = seq.n
    return seq.room - 1 >= k and target.length == n - 1 and (k == 0 or (n >= 2 and draft.length >= n - 2))


def round_graph(draft: StaticRunner, target: StaticRunner, k: int, sampling: SamplingConfig, vocab: int,
                seq: TokenBuffer) -> RoundGraph:
    """The round graph of these runners' buffers, K, the target's bucket for K + 1 tokens and
    ``sampling``: kept on the target's graph set, captured on its first use (on ``seq``'s state)."""
    width = next(b for b in target.buckets if b >= k + 1)
    key = (id(draft.graph_set), k, width, sampling.temperature, sampling.top_k, sampling.top_p, vocab)
    rounds = target.graph_set.rounds
    graph = rounds.get(key)
    if graph is None:
        graph = RoundGraph(draft, target, k, sampling, vocab, width)
        graph.bind(seq)
        pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        steps = model_steps(target.model)
        compiling = sum(steps.compile_seconds.values()) + sum(model_steps(draft.model).compile_seconds.values())
        seconds = graph.capture(seq, pool)
        compiled = (sum(steps.compile_seconds.values()) + sum(model_steps(draft.model).compile_seconds.values())
                    - compiling)
        steps.capture_seconds[("round", k, width, target.cache.size)] = seconds - compiled
        steps.captures += 1
        rounds[key] = graph
    else:
        graph.bind(seq)
    return graph


def round_graphs(target) -> list[RoundGraph]:
    """Every round graph captured over ``target``'s buffers in this process (its graph sets')."""
    sets = model_steps(target).graph_sets.values()
    return [graph for group in sets for graph_set in group for graph in graph_set.rounds.values()]
