"""PEARL (Liu et al., "Parallel Speculative Decoding with Adaptive Draft Length") on one machine:
the draft drafts its next block while the target verifies the previous one.

Rounds follow the authors' code (methods/svip_and_pearl.md, 2.3), with both models on one device:

- **pre-verify** (nothing pending): the target scores the committed prefix (one row) while the
  draft drafts a block x_1..x_gamma from the same prefix. Only x_1 is tested. Rejected: the
  residual token is committed and the block dropped. Accepted: x_1 is committed and x_2..x_gamma
  stay *pending*: post-verify.
- **post-verify** (m pending): the target scores the prefix plus the pending drafts (m + 1 rows)
  while the draft drafts the next block y_1..y_gamma after them. The pending drafts and y_1 are
  tested. All accepted: they are committed with **no bonus token** and y_2..y_gamma become the
  pending drafts. A rejection commits the residual token, drops everything after it: pre-verify.

A round costs max(draft block, target forward) instead of their sum. Every test is the usual
min(1, p/q) with the (p - q)+ residual (:func:`verify` with ``bonus=False``) on draft tokens
sampled afresh from q, and which tokens are tested never depends on their values, so the output
has the target's distribution; only verified tokens are returned (EOS and the length limit cut
the committed tokens, pending drafts are dropped). Randomness: two generators seeded from the
user's at the start, one for the draft's samples (drawn only by the worker, in drafting order)
and one for the verification (drawn only by the caller's thread), so the output does not depend
on which model finishes first.

Concurrency lives in :class:`_DraftWorker` only: on CPU a thread (each side runs its ops with
``num_threads`` intra-op threads and the GIL switch interval is shortened during ``generate``,
since the HF forward's Python overhead needs the GIL); on CUDA the worker's kernels go to their
own stream.

Statistics: a round's ``candidate_lengths`` entry is the number of drafts tested and
``accept_lengths`` the number accepted; ``n_draft_calls`` counts every drafted token. Since a
fully accepted round samples no token from the target, the SD identity becomes
N_draft + N_target = N + N_discarded + N_no_target_token (``PEARLStats.n_no_target_token``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .engine import GenerateOutput, RunStats, _Runner, check_generate_args
from .loading import token_set
from .policies import StopPolicy
from .reduced_vocab import output_vocab_size
from .sampling import SamplingConfig, sample, warp
from .verify import verify

MAX_AUTO_GAMMA = 16


@dataclass
class PEARLStats(RunStats):
    """:class:`RunStats` plus PEARL's own counts and the measured concurrency.

    ``overlap_time_s``: time both models were busy at once (per round, the intersection of the
    draft block's and the target forward's intervals); ``draft_time_s`` / ``target_time_s`` are the
    two intervals' sums, so ``wall_time_s`` >= draft + target - overlap."""

    gamma: int = 0
    n_pre_verify_rounds: int = 0
    n_post_verify_rounds: int = 0
    n_no_target_token: int = 0
    overlap_time_s: float = 0.0

    @property
    def overlap_share(self) -> float:
        """Overlap / the shorter side's busy time: 1 = the shorter model was hidden entirely."""
        shorter = min(self.draft_time_s, self.target_time_s)
        return self.overlap_time_s / shorter if shorter > 0 else float("nan")


def _time_forwards(model, vocab: int, context: torch.Tensor, steps: int) -> float:
    """Median seconds of a cached one-token forward after ``context``."""
    runner, times = _Runner(model, vocab, want_hidden=False), []
    runner.feed(context)
    for i in range(steps + 2):
        t0 = time.perf_counter()
        runner.feed(context[i % len(context)].view(1))
        if i >= 2:  # two warm-up calls
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def theorem1_gamma(draft, target, context_len: int = 64, steps: int = 8,
                   max_gamma: int = MAX_AUTO_GAMMA) -> tuple[int, float, float]:
    """PEARL's Theorem 1: gamma = t_target / t_draft (one cached token each, measured here, on the
    models' device, alone). Returns ``(gamma, t_draft_s, t_target_s)``; gamma in [1, max_gamma]."""
    vocab = min(output_vocab_size(draft), output_vocab_size(target))
    context = torch.arange(context_len, device=target.device) % vocab
    t_draft = _time_forwards(draft, vocab, context, steps)
    t_target = _time_forwards(target, vocab, context, steps)
    return max(1, min(max_gamma, round(t_target / t_draft))), t_draft, t_target


@contextmanager
def _cpu_threads(device: torch.device, num_threads: int | None, switch_interval: float | None):
    """Intra-op threads and the GIL switch interval for one ``generate`` (both process-wide)."""
    if device.type != "cpu":
        yield
        return
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    if num_threads:
        torch.set_num_threads(num_threads)
    if switch_interval:
        sys.setswitchinterval(switch_interval)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)


class _DraftWorker:
    """The draft's side of a round, run beside the caller's thread: ``submit(fn)`` starts ``fn``
    (no grad, its own CUDA stream after the caller's queued work), ``result()`` waits for it. The
    one place that knows about threads and streams."""

    def __init__(self, device: torch.device, num_threads: int | None) -> None:
        self.device, self.num_threads = device, num_threads
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pearl-draft", initializer=self._init)
        self.future = None

    def _init(self) -> None:
        if self.device.type == "cpu" and self.num_threads:
            torch.set_num_threads(self.num_threads)

    def _run(self, fn, caller_stream):
        with torch.no_grad():  # grad mode is per thread
            if self.stream is None:
                return fn()
            self.stream.wait_stream(caller_stream)
            with torch.cuda.stream(self.stream):
                out = fn()
            self.stream.synchronize()
            return out

    def submit(self, fn) -> None:
        caller = torch.cuda.current_stream(self.device) if self.stream is not None else None
        self.future = self.pool.submit(self._run, fn, caller)

    def result(self):
        out, self.future = self.future.result(), None
        return out

    def __enter__(self) -> _DraftWorker:
        return self

    def __exit__(self, *exc) -> None:
        if self.future is not None:  # an error on the caller's side: let the draft finish first
            self.future.exception()
        self.pool.shutdown(wait=True)


def _now(device: torch.device) -> float:
    """perf_counter after the calling thread's own CUDA stream is done (never the other's)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


class PEARLDecoder:
    """PEARL with pre-verify and post-verify rounds; ``generate`` and its output as
    :class:`~specdecpp.SpeculativeDecoder`'s (the stats are :class:`PEARLStats`).

    gamma: the draft block length, an integer or ``"auto"`` (Theorem 1: t_target / t_draft,
    measured on the first ``generate``; see :func:`theorem1_gamma`).
    policy: optionally a :class:`StopPolicy` (SVIP, SpecDecPP) that ends a draft block early
    (at most gamma drafts a block either way).
    num_threads: torch intra-op threads for each of the two sides on CPU during ``generate``
    (None: leave torch's setting). switch_interval: the GIL switch interval during ``generate``
    on CPU, in seconds (None: leave Python's 5 ms, which starves the target's Python overhead).
    """

    def __init__(self, draft, target, gamma: int | str = "auto", sampling: SamplingConfig | None = None,
                 policy: StopPolicy | None = None, num_threads: int | None = 1,
                 switch_interval: float | None = 1e-4) -> None:
        if gamma != "auto" and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1):
            raise ValueError(f"PEARLDecoder: gamma must be an integer >= 1 or 'auto', got {gamma!r}")
        if policy is not None and not isinstance(policy, StopPolicy):
            raise TypeError(f"PEARLDecoder: policy must be a StopPolicy or None, got {type(policy).__name__}")
        if draft.device != target.device:
            raise ValueError(f"draft is on {draft.device} but target on {target.device}; load them on one device")
        self.draft, self.target, self.policy = draft, target, policy
        self.sampling = sampling or SamplingConfig()
        self.vocab = min(output_vocab_size(draft), output_vocab_size(target))
        self.device = target.device
        self.num_threads, self.switch_interval = num_threads, switch_interval
        self.gamma_setting = gamma
        self.gamma: int | None = None if gamma == "auto" else gamma
        self.costs: dict | None = None  # Theorem 1's measurement, when gamma="auto"
        if policy is not None:
            policy.bind(draft, self.sampling.temperature)

    def resolve_gamma(self) -> int:
        if self.gamma is None:
            with _cpu_threads(self.device, self.num_threads, None):
                self.gamma, t_draft, t_target = theorem1_gamma(self.draft, self.target)
            self.costs = {"t_draft_s": t_draft, "t_target_s": t_target}
        return self.gamma

    def _draft_block(self, runner: _Runner, seq: torch.Tensor, start: int, count: int,
                     gen: torch.Generator | None, eos: set[int]):
        """Draft seq[start : start + k] (k <= count) after seq[:start]; return (k, q rows, t0, t1).
        Stops early at EOS or where the policy says."""
        t0 = _now(self.device)
        cfg, policy, q_rows, k = self.sampling, self.policy, [], 0
        needs_hidden = policy is not None and policy.needs_hidden
        if policy is not None:
            policy.new_round()
        while k < count:
            logits, hidden = runner.feed(seq[runner.length : start + k])
            if cfg.greedy:
                y = logits[-1].argmax(-1)
            else:
                q_k = warp(logits[-1], cfg)
                y = sample(q_k, gen)
                q_rows.append(q_k)
            seq[start + k] = y
            k += 1
            if (policy is not None and policy.should_stop(k, logits[-1], hidden[-1] if needs_hidden else None)) \
                    or (eos and int(y) in eos):
                break
        return k, q_rows, t0, _now(self.device)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int = 128,
                 generator: torch.Generator | None = None,
                 eos_token_id: int | Iterable[int] | None = None,
                 return_caches: bool = False) -> GenerateOutput:
        check_generate_args(prompt_ids, max_new_tokens)
        gamma = self.resolve_gamma()
        eos, cfg = token_set(eos_token_id), self.sampling
        # two streams of randomness fixed up front: the draft's samples and the verification's
        seeds = torch.randint(0, 2**62, (2,), generator=generator,
                              device=generator.device if generator is not None else "cpu").tolist()
        draft_gen, verify_gen = (torch.Generator(self.device).manual_seed(s) for s in seeds)
        draft = _Runner(self.draft, self.vocab, want_hidden=self.policy is not None and self.policy.needs_hidden)
        target = _Runner(self.target, self.vocab, want_hidden=False)
        stats = PEARLStats(gamma=gamma)
        prompt_len = prompt_ids.shape[1]
        end = prompt_len + max_new_tokens  # no token is drafted at or beyond it
        seq = torch.empty(end + 1, dtype=torch.long, device=self.device)
        seq[:prompt_len] = prompt_ids[0]
        n, q_pending = prompt_len, []  # committed: seq[:n]; pending drafts: seq[n : n + len(q_pending)]
        m = 0  # number of pending drafts (q_pending is empty under greedy decoding)
        t_start = time.perf_counter()

        with _cpu_threads(self.device, self.num_threads, self.switch_interval), draft, \
                _DraftWorker(self.device, self.num_threads) as worker:
            while n < end:
                count = min(gamma, end - n - m)  # the next block, never past the length limit
                if m and eos and int(seq[n + m - 1]) in eos:
                    count = 0  # the pending drafts end on EOS: nothing can follow it
                if count:
                    worker.submit(lambda start=n + m, count=count: self._draft_block(
                        draft, seq, start, count, draft_gen, eos))
                t0 = _now(self.device)
                # p(. | seq[:n + i]) for i = 0..m: tests the m pending drafts and the block's first
                logits = target.feed(seq[target.length : n + m], n_logits=m + 1)[0]
                t1 = _now(self.device)
                k, q_new, d0, d1 = worker.result() if count else (0, [], t1, t1)

                stats.n_post_verify_rounds += m > 0
                stats.n_pre_verify_rounds += m == 0
                n_test = m + min(k, 1)
                tested = seq[n : n + n_test]
                if cfg.greedy:
                    n_acc, token = verify(tested, None, logits[:n_test], greedy=True, bonus=False)
                else:
                    q = torch.stack(q_pending + q_new[:1])
                    n_acc, token = verify(tested, q, warp(logits[:n_test], cfg), verify_gen, bonus=False)
                if token is not None:  # a rejection: the residual token replaces the draft
                    seq[n + n_acc] = token
                new = seq[n : n + n_acc + (token is not None)].tolist()
                hit_eos = next((i for i, t in enumerate(new) if t in eos), None)
                kept = len(new) if hit_eos is None else hit_eos + 1
                rejected = token is not None or hit_eos is not None
                stats.n_discarded += len(new) - kept  # committed, then cut after an EOS
                if rejected:  # every untested or rejected draft is dropped
                    stats.n_discarded += (m + k) - n_acc
                    q_pending, m = [], 0
                else:  # all tested drafts accepted: the block's rest is pending
                    q_pending, m = q_new[1:], max(k - 1, 0)
                n += kept
                target.rollback(n - 1)
                draft.rollback(min(draft.length, n + m - 1))

                stats.n_draft_calls += k
                stats.n_target_calls += 1
                stats.n_no_target_token += token is None
                stats.accept_lengths.append(n_acc)
                stats.candidate_lengths.append(n_test)
                stats.draft_time_s += d1 - d0
                stats.target_time_s += t1 - t0
                stats.overlap_time_s += max(0.0, min(d1, t1) - max(d0, t0))
                if hit_eos is not None:
                    break
            stats.n_discarded += m  # drafts still pending at the limit are never returned

        stats.wall_time_s = _now(self.device) - t_start
        stats.n_generated = n - prompt_len
        return GenerateOutput(tokens=seq[:n].unsqueeze(0).clone(), stats=stats,
                              caches={"draft": draft.cache, "target": target.cache} if return_caches else None)

    def settings(self) -> dict:
        return {"gamma": self.gamma_setting, "policy": None if self.policy is None else self.policy.name,
                **({} if self.policy is None else self.policy.settings())}
