"""The graphs a captured round is made of (docs/engine.md, "Captured rounds", where the fast path's
CUDA graphs take a whole round, or an adaptive policy's round in pieces): :class:`RoundParts`, a round's
two halves as functions of device state only over a draft and a target runner's buffers;
:class:`RoundGraph`, a fixed-K or target-only round as one graph, read once on the host; :class:`StepGraphs`,
one graph per candidate (the policy deciding on the device) and one per K for the verdict; and the work
between the forwards (:func:`draw_row`, :func:`verdict_rule`), compiled by inductor in a fused round
(:func:`compile_glue`). When a call captures and replays them: specdecpp/decoders/replay.py."""

from __future__ import annotations

import functools
import time

import torch

from ..core.sampling import INVALID_PROBS, SamplingConfig, argmax, draw_with, rows_valid, warp
from ..core.verify import acceptance_ratio, residual
from ..fast import graphs as fast_graphs
from ..fast.buckets import fit_buckets
from ..fast.runners import StaticRunner
from ..fast.step import model_steps, own_code
from ..stopping.policies import StopPolicy
from .rounds import TokenBuffer


class RoundParts:
    """What a captured round is built from, over a draft and a target runner's buffers: a token
    buffer with ``n`` (the committed count) on the device, the round's uniforms, and the round's two
    halves as functions of device state only (no host read), :meth:`candidate` and :meth:`verdict`.
    :class:`RoundGraph` captures a whole fixed-K round from them, :class:`StepGraphs` an adaptive
    policy's candidates one graph each and its verdicts one graph per K."""

    def __init__(self, draft: StaticRunner, target: StaticRunner, k: int, sampling: SamplingConfig, vocab: int,
                 widths: dict[int, int], fused: bool = False) -> None:
        """``k``: the most candidates a round drafts; ``widths``: the target's bucket for each K;
        ``fused``: the work between the forwards (a candidate's draw, the verdict's rule) compiled
        by inductor, one function per K (docs/engine.md, "Captured rounds": ``capture_rounds="fused"``)."""
        device = target.device
        self.k, self.sampling, self.vocab, self.widths = k, sampling, vocab, widths
        self.greedy, self.fused = sampling.greedy, fused
        self._draw = compile_glue(draw_row(sampling), "round_draw") if fused else draw_row(sampling)
        self._rules: dict = {}
        self.tokens = torch.zeros(target.cache.size + 1, dtype=torch.long, device=device)
        self.n = torch.ones((), dtype=torch.long, device=device)  # set by the host before each round
        self.u = torch.zeros(2 * k + 1, dtype=torch.float64, device=device)
        self.two = torch.arange(2, device=device)
        self.offsets = torch.arange(k, device=device)
        self.draft_two = draft.forward_at(2) if k else None
        self.draft_one = draft.forward_at(1) if k > 1 else None
        self.target_fwd = {kk: target.forward_at(w) for kk, w in widths.items()}
        # tokens[n - 1 + pad]
        self.pads = {kk: torch.arange(w, device=device).clamp_(max=kk) for kk, w in widths.items()}

    def draft_forward(self, i: int, previous: torch.Tensor | None):
        """The draft's forward that scores candidate ``i``: ``tokens[n - 2 : n]`` at slots ``n - 2, n - 1``
        (i = 0), else ``previous`` (the candidate before, [1] or 0-d) at slot ``n + i - 1``; logits [W, V]
        and hidden [W, H], the last row the candidate's."""
        if i == 0:
            return self.draft_two(self.tokens.index_select(0, self.n - 2 + self.two), self.n - 2)
        return self.draft_one(previous.reshape(1), self.n + (i - 1))

    def target_forward(self, k: int) -> torch.Tensor:
        """The target's forward over ``tokens[n - 1 : n + k]`` (padded to its bucket); logits [W, V]."""
        return self.target_fwd[k](self.tokens.index_select(0, self.n - 1 + self.pads[k]), self.n - 1)[0]

    def candidate(self, i: int, previous: torch.Tensor | None):
        """Draft candidate ``i`` (0-based) after ``tokens[:n + i]``: the draft feeds ``tokens[n - 2 :
        n]`` (i = 0) or ``previous`` (the candidate before, 0-d) and draws ``y`` from its row with
        uniform ``u[i]`` (greedy: the argmax). Returns ``(y, q, row, hidden)``: the candidate (0-d),
        the row q it was drawn from (None under greedy), the draft's raw logits row [V] and its
        final hidden state [H]."""
        logits, hidden = self.draft_forward(i, previous)
        row, hidden = logits[-1, : self.vocab], hidden[-1]
        y, q = self._draw(row, self.u[i : i + 1])
        return y, q, row, hidden

    def _rule(self, k: int):
        """The verdict's rule for ``k`` candidates (:func:`verdict_rule`), compiled where ``fused``."""
        rule = self._rules.get(k)
        if rule is None:
            rule = verdict_rule(self.sampling, self.k, k)
            rule = self._rules[k] = compile_glue(rule, f"round_rule_k{k}") if self.fused else rule
        return rule

    def verdict(self, k: int, drafted: torch.Tensor, q_rows: torch.Tensor | None) -> torch.Tensor:
        """The target's verification of ``drafted`` [k] (already in ``tokens[n : n + k]``), drawn from
        ``q_rows`` [k, V]: the exact rule with uniforms ``u[K:K + k]`` and ``u[2K]`` (K the most
        candidates), the next token written after the accepted ones. Returns ``[n_accepted, valid,
        y_1..y_k, token]``. ``n`` stays: the host sets it before each round (so a capture's warm-ups
        all run at one position)."""
        logits = self.target_forward(k)[: k + 1, : self.vocab]
        n_acc, valid, token = self._rule(k)(logits, drafted, q_rows, self.u)
        self.tokens.index_copy_(0, (self.n + n_acc).reshape(1), token)
        return torch.cat([n_acc.reshape(1), valid.reshape(1), drafted, token])

    def bind(self, seq: TokenBuffer) -> None:
        """Make ``seq`` keep its tokens in this graph's buffer (a view of it; the prompt copied over)."""
        size = seq.tokens.shape[0]
        if size > self.tokens.shape[0]:
            raise ValueError(f"a round graph holds {self.tokens.shape[0]} tokens; the call needs {size}")
        self.tokens[:size] = seq.tokens
        seq.tokens = self.tokens[:size]

    def start(self, seq: TokenBuffer, generator: torch.Generator | None) -> None:
        """Before a round's first replay: ``n`` set (a fill, no read), the round's uniforms drawn."""
        self.n.fill_(seq.n)
        if not self.greedy:
            self.u.uniform_(generator=generator)

    def verdict_read(self, read: list[int], seq: TokenBuffer, k: int) -> tuple[int, int, list[int]]:
        """``(n_accepted, token, drafts)`` from a verdict's values read on the host, or sample's ValueError."""
        n_acc, valid, drafts, token = read[0], read[1], read[2 : 2 + k], read[2 + k]
        if not valid:
            raise ValueError(INVALID_PROBS)
        return n_acc, token, drafts


def compile_glue(fn, name: str):
    """``fn`` compiled by inductor (fullgraph, fixed shapes) under a code object of its own (dynamo
    counts its variants per code object: ``fast.step.own_code``)."""
    return torch.compile(own_code(fn, name), fullgraph=True, dynamic=False)


def draw_row(sampling: SamplingConfig):
    """A candidate's draw from the draft's raw logits row [V] with its uniform ``u`` [1]: ``(y, q)``,
    the candidate (0-d) and the row q it was drawn from (None under greedy: the argmax). Unchecked:
    the verdict checks the rows q (:func:`verdict_rule`)."""
    def draw(row: torch.Tensor, u: torch.Tensor):
        if sampling.greedy:
            return argmax(row).reshape(()), None
        q = warp(row, sampling)
        return draw_with(q, u, check=False)[0].reshape(()), q
    return draw


def verdict_rule(sampling: SamplingConfig, k_max: int, k: int):
    """The exact rule over the target's logits [k + 1, V] for ``drafted`` [k] drawn from ``q_rows``
    [k, V], with the round's uniforms ``u`` [2 k_max + 1] (tests ``u[k_max : k_max + k]``, the next
    token's draw ``u[2 k_max]``): ``(n_accepted, valid, token)``, 0-d, 0-d and [1] long tensors."""
    def rule(logits: torch.Tensor, drafted: torch.Tensor, q_rows: torch.Tensor | None, u: torch.Tensor):
        if sampling.greedy:
            top = argmax(logits)
            n_acc = (top[:k] == drafted).long().cumprod(0).sum() if k else top.new_zeros(())
            return n_acc, torch.ones_like(n_acc), top.gather(0, n_acc.reshape(1))
        p = warp(logits, sampling)
        rows, q_ok = p, None
        if not k:
            n_acc = logits.new_zeros((), dtype=torch.long)
        else:
            ratio = acceptance_ratio(p[:k], q_rows, drafted)
            n_acc = (u[k_max : k_max + k] < ratio).long().cumprod(0).sum()
            rows = torch.cat([residual(p[:k], q_rows), p[k:]])  # row i < k: a rejection at i's residual; row k: p_{k+1}
            q_ok = rows_valid(q_rows)  # the check the draft's draws left out
        each, ok = draw_with(rows, u[2 * k_max :])  # one uniform: the chosen row's draw
        valid = ok.gather(0, n_acc.reshape(1))[0]
        return n_acc, (valid if q_ok is None else valid & q_ok).long(), each.gather(0, n_acc.reshape(1))
    return rule


class RoundGraph(RoundParts):
    """A whole fixed-K (or target-only) round as one graph (docs/engine.md, "Captured rounds"); built by
    :func:`~specdecpp.decoders.replay.round_graph`. ``bind(seq)`` points a call's token buffer at the
    graph's; ``run(seq, count, generator)`` replays it and returns ``(K, n_accepted, token, drafts)``
    after one host read."""

    def __init__(self, draft: StaticRunner, target: StaticRunner, k: int, sampling: SamplingConfig, vocab: int,
                 width: int, fused: bool = False) -> None:
        super().__init__(draft, target, k, sampling, vocab, {k: width}, fused)
        self.width = width
        self.replay = self.out = None

    def _round(self) -> tuple[torch.Tensor]:
        drafts, q_rows, y = [], [], None
        for i in range(self.k):
            y, q, _, _ = self.candidate(i, y)
            drafts.append(y)
            q_rows.append(q)
        drafted = torch.stack(drafts) if self.k else self.n.new_zeros(0)
        if self.k:
            self.tokens.index_copy_(0, self.n + self.offsets, drafted)
        q = torch.stack(q_rows) if self.k and not self.greedy else None
        return (self.verdict(self.k, drafted, q),)

    def forwards(self) -> tuple[torch.Tensor, ...]:
        """The round's forwards alone: the same widths, slots and buffers, each draft forward fed the
        token the buffer holds there, no draw, rule or write of ``n``. What a benchmark captures to
        time the round graph against (scripts/bench_fast.py ``--round-graphs``); its forwards write
        the caches above ``n`` only, which the next round writes again."""
        outs = [self.draft_forward(i, self.tokens.index_select(0, (self.n + (i - 1)).reshape(1)) if i else None)[0]
                for i in range(self.k)]
        return (*outs, self.target_forward(self.k))

    def capture(self, seq: TokenBuffer, pool) -> float:
        """Capture the round at ``seq``'s ``n`` (the warm-ups run it for real: what they write above
        ``n`` the first replay writes again). Seconds it took."""
        t0 = time.perf_counter()
        self.n.fill_(seq.n)
        with torch.no_grad():
            self.replay, (self.out,) = fast_graphs.capture_graph(self._round, pool)
        return time.perf_counter() - t0

    def run(self, seq: TokenBuffer, count: int, generator: torch.Generator | None) -> tuple[int, int, int, list[int]]:
        """One round: ``(K, n_accepted, token, drafts)`` after one host read (``count``, the
        candidates the round has room for, is at least K: :func:`~specdecpp.decoders.replay.replayable`)."""
        self.start(seq, generator)
        self.replay()
        return (self.k, *self.verdict_read(self.out.tolist(), seq, self.k))  # the round's one host read


class StepGraphs(RoundParts):
    """An adaptive policy's round (SVIP, the heads: any policy with ``stop_rows``) as graphs: one per
    candidate (the draft's forward, the draw, the policy's decision on the device, the candidate and
    its q kept), read on the host after each replay (the stop flag and the candidate, as the
    uncaptured drafter reads a value-reading policy's decision), then one per K for the verdict
    (the target's forward and the exact rule over the candidates kept), read once. Built by
    :func:`~specdecpp.decoders.replay.step_graphs`; every graph is captured at once on first use, in
    order, so that a policy's round state (SpecDec++'s running product, allocated by its first
    candidate's decision) is one tensor across the candidates' graphs. ``policy.generated`` is a device tensor the first
    candidate's graph sets (a head's position feature reads it)."""

    def __init__(self, draft: StaticRunner, target: StaticRunner, policy: StopPolicy, k: int, sampling: SamplingConfig,
                 vocab: int, eos: set[int], fused: bool = False) -> None:
        """``k``: the most candidates a round drafts (:func:`~specdecpp.decoders.replay.round_plan`);
        ``eos``: the tokens that end a block (where the policy reads values, as the uncaptured drafter)."""
        widths = {kk: fit_buckets(kk + 1, target.buckets)[-1] for kk in range(1, k + 1)}
        super().__init__(draft, target, k, sampling, vocab, widths, fused)
        device = target.device
        self.policy, self.eos = policy, eos
        self.needs_hidden = policy.needs_hidden
        self.drafted = torch.zeros(k, dtype=torch.long, device=device)
        self.q = None if self.greedy else torch.zeros(k, vocab, dtype=torch.float32, device=device)
        self.prompt_len = torch.zeros((), dtype=torch.long, device=device)
        self.generated = torch.zeros((), dtype=torch.long, device=device)
        self.active = torch.ones(1, dtype=torch.bool, device=device)
        self.steps: list = []  # (replay, out) per candidate
        self.verdicts: dict = {}  # K -> (replay, out)

    def _candidate_step(self, i: int) -> tuple[torch.Tensor]:
        if i == 0:  # the policy's round state, made anew by this graph; the round's start in the response
            self.policy.begin_round(self.generated)
            self.generated.copy_(self.n - self.prompt_len)
        y, q, row, hidden = self.candidate(i, None if i == 0 else self.drafted[i - 1])
        self.drafted[i : i + 1] = y
        self.tokens.index_copy_(0, (self.n + i).reshape(1), y.reshape(1))
        if q is not None:
            self.q[i] = q
        stop = self.policy.stop_rows(i + 1, row[None], hidden[None] if self.needs_hidden else None, y.reshape(1),
                                     self.active)
        return (torch.stack([stop.reshape(()).long(), y]),)

    def capture(self, seq: TokenBuffer, pool) -> float:
        """Every candidate's graph, then every verdict's, at ``seq``'s ``n`` (the warm-ups run them for
        real: the candidates' write the tokens the verdicts' read). Seconds it took."""
        t0 = time.perf_counter()
        with torch.no_grad():
            self.n.fill_(seq.n)  # (bind set prompt_len)
            for i in range(self.k):
                replay, (out,) = fast_graphs.capture_graph(functools.partial(self._candidate_step, i), pool)
                self.steps.append((replay, out))
            for k in range(1, self.k + 1):
                q = None if self.q is None else self.q[:k]
                replay, (out,) = fast_graphs.capture_graph(functools.partial(self._verdict_step, k, q), pool)
                self.verdicts[k] = (replay, out)
        return time.perf_counter() - t0

    def _verdict_step(self, k: int, q: torch.Tensor | None) -> tuple[torch.Tensor]:
        return (self.verdict(k, self.drafted[:k], q),)

    def bind(self, seq: TokenBuffer) -> None:
        super().bind(seq)
        self.prompt_len.fill_(seq.prompt_len)

    def run(self, seq: TokenBuffer, count: int, generator: torch.Generator | None) -> tuple[int, int, int, list[int]]:
        """One round of at most ``count`` candidates: ``(k, n_accepted, token, drafts)``, a host read
        after each candidate (its stop flag and value: the policy's decision, or EOS among the
        candidates, ends the block) and one after the verdict."""
        self.start(seq, generator)
        k = 0
        while k < count:
            replay, out = self.steps[k]
            replay()
            stop, y = out.tolist()
            k += 1
            if stop or y in self.eos:
                break
        replay, out = self.verdicts[k]
        replay()
        return (k, *self.verdict_read(out.tolist(), seq, k))


def round_graphs(target) -> list[RoundGraph]:
    """Every whole-round graph (:class:`RoundGraph`) captured over ``target``'s buffers in this process."""
    sets = model_steps(target).graph_sets.values()
    return [graph for group in sets for graph_set in group for graph in graph_set.rounds.values()
            if isinstance(graph, RoundGraph)]
