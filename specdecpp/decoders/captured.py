"""Captured rounds: a whole chain round of fixed K (or target-only) replayed as one CUDA graph.

Under ``fast="graphs"`` / ``"compile-graphs"`` each forward is a graph replay, but the rest of a
round (the draws, the acceptance rule, staging each forward's inputs, the commit) is some hundred
small kernels launched one by one from Python, which on an H100 took 17-42% of a fast round
(docs/results/gpu.md). Where nothing in a round depends on a value read on the host, the round can
be captured whole, as gpt-fast and vLLM capture a decoding step: under :class:`~specdecpp.stopping.
policies.FixedK` and :class:`~specdecpp.stopping.policies.TargetOnly` a round always drafts K
candidates, so the round is one graph, replayed once per round, and the host reads one small
tensor (the verdict, the drafts and the next token) after it (:class:`RoundGraph`). An adaptive
policy (SVIP, the heads: any policy with ``stop_rows``) decides after each candidate, so its round is
captured in pieces (:class:`StepGraphs`): one graph per candidate, in which the policy decides on the
device and the host reads the decision (as the uncaptured drafter reads it), then one graph per K
for the verdict, read once. A :class:`SpeculativeDecoder` uses them by default on the graph
backends (``capture_rounds=False`` turns them off).

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
4. the next token is written after the accepted ones, and ``[n_accepted, valid, y_1..y_K, token]``
   is left in one output tensor. ``n`` is set by the host before each replay (a fill, no read), so
   a capture's warm-ups all run at one position.

Randomness: the 2K + 1 uniforms of a round (K draws, K tests, the next token's draw) are drawn
from the call's generator into the graph's input before each replay (one kernel), so the graph
holds no generator and the same seed gives the same output. They are other draws than the
uncaptured round's (which takes the next token's draw only after the verdict), so a captured and an
uncaptured call with one seed give different samples, each with the target's exact distribution
(tests/decoders/test_captured_rounds.py).

Where the round is not captured: the first round of a call (the prefill), a round with room for
fewer than K candidates (the end of a call; an adaptive round: for none), a call with logits hooks
(transformers' processors), ``profile=True`` (the round's draft and target times cannot be split
inside one graph), cascades, and a policy without ``stop_rows`` or with more candidates than the
widest bucket holds.

Fused rounds (``SpeculativeDecoder(..., fast="compile-graphs", capture_rounds="fused")``): the work
between a round's forwards, a candidate's draw (:func:`draw_row`) and the verdict's rule
(:func:`verdict_rule`, one function per K), is compiled by inductor (fullgraph, fixed shapes) before
the capture, so the graph replays a few fused kernels where the plain round replays some hundred
small ones (``scripts/count_step_ops.py --captured``: 101 operations beyond the forwards in a sampled
K = 3 round). Inside a compiled region the warp takes the dense top-k and the argmax torch's own (the
CPU's sparse rows and numpy argmax read the host). Compiling happens in the capture's warm-ups and
counts in its ``capture_seconds``. Not measured on a GPU yet, hence not the default
(docs/gpu.md, "What the next lent GPU should run").

A round graph is captured once per process for a (draft buffers, target buffers, K, width,
sampling) and kept on the target's :class:`~specdecpp.fast.graphs.GraphSet` with a token buffer and
the uniforms of its own (a call's :class:`~specdecpp.decoders.rounds.TokenBuffer` is bound to that
buffer); what a capture costs is counted in ``model_steps(target).capture_seconds`` under
``("round", K, width, size)``.
"""

from __future__ import annotations

import functools
import time

import torch

from ..core.sampling import INVALID_PROBS, SamplingConfig, argmax, draw_with, rows_valid, warp
from ..core.verify import acceptance_ratio, residual
from ..fast import graphs as fast_graphs
from ..fast.buckets import GRAPH_BACKENDS, fit_buckets
from ..fast.runners import StaticRunner
from ..fast.step import model_steps, own_code
from ..stopping.policies import FixedK, StopPolicy, TargetOnly
from .rounds import CallHooks, TokenBuffer


def round_plan(policy, fast: str | None, capture: bool, cascade, profile: bool, hooks: CallHooks | None,
               target_buckets: tuple[int, ...], max_new_tokens: int) -> tuple[str, int] | None:
    """How a call's rounds are captured (module docstring): ``("round", K)`` for fixed K and
    target-only (a whole round one graph), ``("steps", K)`` for a policy that decides on the device
    (``stop_rows``: SVIP, the heads) with at most K candidates a round (its ``max_candidates``, or
    fewer where the call has room for fewer), None where they are not captured (also where K + 1
    tokens are wider than the widest bucket)."""
    if not capture or fast not in GRAPH_BACKENDS or cascade is not None or profile:
        return None
    if hooks is not None and (hooks.draft_logits is not None or hooks.target_logits is not None):
        return None
    if isinstance(policy, (FixedK, TargetOnly)):
        k, how = policy.max_candidates, "round"
    elif type(policy).stop_rows is StopPolicy.stop_rows:  # it decides one row at a time, on the host
        return None
    else:
        k, how = min(policy.max_candidates, max_new_tokens - 1), "steps"
        if k < 1:
            return None
    return (how, k) if k + 1 <= target_buckets[-1] else None


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
        by inductor, one function per K (module docstring, "Fused rounds")."""
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
    """A whole fixed-K (or target-only) round as one graph (module docstring); built by
    :func:`round_graph`. ``bind(seq)`` points a call's token buffer at the graph's; ``run(seq, count,
    generator)`` replays it and returns ``(K, n_accepted, token, drafts)`` after one host read."""

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
        candidates the round has room for, is at least K: :func:`replayable`)."""
        self.start(seq, generator)
        self.replay()
        return (self.k, *self.verdict_read(self.out.tolist(), seq, self.k))  # the round's one host read


class StepGraphs(RoundParts):
    """An adaptive policy's round (SVIP, the heads: any policy with ``stop_rows``) as graphs: one per
    candidate (the draft's forward, the draw, the policy's decision on the device, the candidate and
    its q kept), read on the host after each replay (the stop flag and the candidate, as the
    uncaptured drafter reads a value-reading policy's decision), then one per K for the verdict
    (the target's forward and the exact rule over the candidates kept), read once. Built by
    :func:`step_graphs`; every graph is captured at once on first use, in order, so that a policy's
    round state (SpecDec++'s running product, allocated by its first candidate's decision) is one
    tensor across the candidates' graphs. ``policy.generated`` is a device tensor the first
    candidate's graph sets (a head's position feature reads it)."""

    def __init__(self, draft: StaticRunner, target: StaticRunner, policy: StopPolicy, k: int, sampling: SamplingConfig,
                 vocab: int, eos: set[int], fused: bool = False) -> None:
        """``k``: the most candidates a round drafts (:func:`round_plan`); ``eos``: the tokens that
        end a block (where the policy reads values, as the uncaptured drafter)."""
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


def replayable(seq: TokenBuffer, k: int, draft, target) -> bool:
    """Whether ``seq``'s next round can be a replay: K candidates fit (an adaptive round: one, ``k``
    None), the target holds ``tokens[:n - 1]`` and the draft at least ``tokens[:n - 2]`` (not so
    before the prefill)."""
    n = seq.n
    fits = seq.room - 1 >= (1 if k is None else k)
    return fits and target.length == n - 1 and (k == 0 or (n >= 2 and draft.length >= n - 2))


class CaptureFailed(RuntimeError):
    """A round's capture failed; the decoder goes on round by round (per-forward graphs)."""


def _kept(draft: StaticRunner, target: StaticRunner, key: tuple, label: tuple, build, seq: TokenBuffer):
    """The captured graphs under ``key`` on the target's graph set, bound to ``seq``; built by
    ``build()`` and captured on ``seq``'s state on first use, the capture's seconds (less any compile
    its warm-ups ran) kept in ``model_steps(target).capture_seconds[label]``."""
    rounds = target.graph_set.rounds
    graphs = rounds.get(key)
    if graphs is not None:
        graphs.bind(seq)
        return graphs
    graphs = build()
    graphs.bind(seq)
    pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
    steps, models = model_steps(target.model), (target.model, draft.model)

    def compiled() -> float:
        return sum(sum(model_steps(m).compile_seconds.values()) for m in models)

    before = compiled()
    try:
        seconds = graphs.capture(seq, pool)
    except RuntimeError as exc:
        raise CaptureFailed(f"capturing {type(graphs).__name__} {label} failed ({exc})") from exc
    steps.capture_seconds[label] = seconds - (compiled() - before)
    steps.captures += 1
    rounds[key] = graphs
    return graphs


def round_graph(draft: StaticRunner, target: StaticRunner, k: int, sampling: SamplingConfig, vocab: int,
                seq: TokenBuffer, fused: bool = False) -> RoundGraph:
    """The round graph of these runners' buffers, K, the target's bucket for K + 1 tokens and
    ``sampling`` (``fused``: its work between forwards compiled): kept on the target's graph set,
    captured on its first use (on ``seq``'s state)."""
    width = fit_buckets(k + 1, target.buckets)[-1]
    key = (id(draft.graph_set), k, width, sampling.temperature, sampling.top_k, sampling.top_p, vocab, fused)
    return _kept(draft, target, key, ("round", k, width, target.cache.size),
                 lambda: RoundGraph(draft, target, k, sampling, vocab, width, fused), seq)


def round_graphs(target) -> list[RoundGraph]:
    """Every whole-round graph (:class:`RoundGraph`) captured over ``target``'s buffers in this process."""
    sets = model_steps(target).graph_sets.values()
    return [graph for group in sets for graph_set in group for graph in graph_set.rounds.values()
            if isinstance(graph, RoundGraph)]


def step_graphs(draft: StaticRunner, target: StaticRunner, policy: StopPolicy, k: int, sampling: SamplingConfig,
                vocab: int, eos: set[int], seq: TokenBuffer, fused: bool = False) -> StepGraphs:
    """The step graphs of these runners' buffers, ``policy`` (this object: its round state lives in
    them), at most ``k`` candidates and ``sampling``: kept on the target's graph set, captured on first
    use (on ``seq``'s state)."""
    key = (id(draft.graph_set), "steps", id(policy), k, sampling.temperature, sampling.top_k, sampling.top_p, vocab,
           tuple(sorted(eos)), fused)
    width = fit_buckets(k + 1, target.buckets)[-1]
    return _kept(draft, target, key, ("steps", k, width, target.cache.size),
                 lambda: StepGraphs(draft, target, policy, k, sampling, vocab, eos, fused), seq)
