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
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..core.attention import decoding
from ..core.sampling import SamplingConfig
from ..core.timing import Clock
from ..fast.buckets import DRAFT_BUCKETS, check_fast, fit_buckets
from ..fast.calls import CallRunners
from ..models.feature_runner import refuse_feature_draft
from ..models.reduced_vocab import output_vocab_size
from ..models.runner import time_cached_forwards
from ..stopping.policies import StopPolicy, check_count
from . import rounds
from .rounds import GenerateOutput, RunStats, finish

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


def theorem1_gamma(draft, target, context_len: int = 64, steps: int = 8,
                   max_gamma: int = MAX_AUTO_GAMMA) -> tuple[int, float, float]:
    """PEARL's Theorem 1: gamma = t_target / t_draft, each the median seconds of one cached token
    after ``context_len`` tokens, measured here on the models' device with nothing else running
    (:func:`~specdecpp.models.runner.time_cached_forwards`: the draft's and the target's calls
    interleaved).
    Returns ``(gamma, t_draft_s, t_target_s)``; gamma in [1, max_gamma]."""
    vocab = min(output_vocab_size(draft), output_vocab_size(target))
    context = torch.arange(context_len, device=target.device) % vocab
    t = time_cached_forwards({"draft": draft, "target": target}, context, context[-1:], repeats=steps, warmup=2)
    t_draft, t_target = t["draft"][1], t["target"][1]
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
    fast: None (eager) or ``"static"`` (both models over the project's static KV cache, run
    eagerly). The compiled backends are refused (:meth:`check_fast`).
    """

    FAST = (None, "static")  # the fast backends PEARL runs (check_fast says why not the others)

    def __init__(self, draft, target, gamma: int | str = "auto", sampling: SamplingConfig | None = None,
                 policy: StopPolicy | None = None, num_threads: int | None = 1,
                 switch_interval: float | None = 1e-4, fast: str | None = None) -> None:
        self.device = rounds.check_pair_devices(draft, target)
        refuse_feature_draft(draft, "PEARLDecoder", "PEARL drafts while the target verifies, before the target's "
                             "features of the drafted positions exist")
        self.fast = check_fast("PEARLDecoder", fast, self.device, draft, target)  # first: it knows the device
        self.check_settings(gamma, num_threads, switch_interval, fast)
        if policy is not None and not isinstance(policy, StopPolicy):
            raise TypeError(f"PEARLDecoder: policy must be a StopPolicy or None, got {type(policy).__name__}")
        self.runners = CallRunners(self.fast, (draft, target))
        self.draft, self.target, self.policy = draft, target, policy
        self.sampling = sampling or SamplingConfig()
        self.vocab = min(output_vocab_size(draft), output_vocab_size(target))
        self.rule = rounds.ExactRule(self.sampling)
        self.num_threads, self.switch_interval = num_threads, switch_interval
        self.gamma_setting = gamma
        self.gamma: int | None = None if gamma == "auto" else gamma
        self.costs: dict | None = None  # Theorem 1's measurement, when gamma="auto"
        if policy is not None:
            policy.bind(draft, self.sampling.temperature)

    @classmethod
    def check_fast(cls, fast) -> None:
        """Refuse a fast backend PEARL does not run. Its draft runs on a second thread (a second
        CUDA stream) beside the target: compiled steps (dynamo's frames, inductor's kernels, CUDA
        graph replays) entered from two threads at once are not something this project has built
        or tested, so PEARL stays eager or runs the static cache without compiling."""
        check_fast("PEARLDecoder", fast)
        if fast not in cls.FAST:
            raise ValueError(f"PEARLDecoder: fast={fast!r} is not supported: PEARL runs the draft on a second thread "
                             "beside the target, and compiled steps shared by two threads are not built here; use "
                             "fast='static' (the static cache, eager) or None")

    @classmethod
    def check_settings(cls, gamma, num_threads, switch_interval, fast=None) -> None:
        """The one check of PEARL's own settings (also run by configs before the models load)."""
        cls.check_fast(fast)
        if gamma != "auto" and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1):
            raise ValueError(f"PEARLDecoder: gamma must be an integer >= 1 or 'auto', got {gamma!r}")
        if num_threads is not None:
            check_count("PEARLDecoder", "num_threads", num_threads)
        if switch_interval is not None and (isinstance(switch_interval, bool) or not isinstance(
                switch_interval, (int, float)) or not switch_interval > 0):
            raise ValueError(f"PEARLDecoder: switch_interval must be a number of seconds > 0 or None, "
                             f"got {switch_interval!r}")

    def resolve_gamma(self) -> int:
        if self.gamma is None:
            with _cpu_threads(self.device, self.num_threads, None):
                self.gamma, t_draft, t_target = theorem1_gamma(self.draft, self.target)
            self.costs = {"t_draft_s": t_draft, "t_target_s": t_target}
        return self.gamma

    @decoding
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int = 128, generator: torch.Generator | None = None,
                 eos_token_id: int | Iterable[int] | None = None, return_caches: bool = False) -> GenerateOutput:
        rounds.check_generate_args(prompt_ids, max_new_tokens, (self.draft, self.target))
        gamma = self.resolve_gamma()
        # two streams of randomness fixed up front: the draft's samples and the verification's
        seeds = torch.randint(0, 2**62, (2,), generator=generator,
                              device=generator.device if generator is not None else "cpu").tolist()
        draft_gen, verify_gen = (torch.Generator(self.device).manual_seed(s) for s in seeds)
        clock = Clock(self.device)  # each thread's reading waits for its own CUDA stream only
        seq = rounds.TokenBuffer(prompt_ids, max_new_tokens, eos_token_id, self.device)
        tokens = seq.end + gamma + 1  # the prompt, the new tokens and a block
        drafter = rounds.Drafter(self.draft, self.vocab, self.policy, self.sampling, seq.eos, clock,
                                 runners=self.runners(tokens, DRAFT_BUCKETS))
        target = self.runners(tokens, fit_buckets(gamma))(self.target, self.vocab, False)
        stats = PEARLStats(gamma=gamma)
        q_pending, m = [], 0  # pending drafts: seq.tokens[n : n + m] (q_pending empty under greedy)
        t_start = clock.now()

        with _cpu_threads(self.device, self.num_threads, self.switch_interval), drafter, \
                _DraftWorker(self.device, self.num_threads) as worker:
            while not seq.finished:
                n = seq.n
                count = min(gamma, seq.room - m)  # the next block, never past the length limit
                if m and drafter.stop_at_eos and int(seq.tokens[n + m - 1]) in seq.eos:
                    count = 0  # the pending drafts end on EOS: nothing can follow it
                if count:
                    worker.submit(lambda start=n + m, count=count: drafter.block(seq.tokens, start, count, draft_gen,
                                                                                     start - seq.prompt_len))
                t0 = clock.now()
                # p(. | tokens[:n + i]) for i = 0..m: tests the m pending drafts and the block's first
                logits = target.feed(seq.tokens[target.length : n + m], n_logits=m + 1)[0]
                t1 = clock.now()
                block = worker.result() if count else rounds.Block(0, [], t1, t1)

                n_test = m + min(block.k, 1)
                tested = rounds.Candidates(seq.tokens[n : n + n_test], q_pending + block.q[:1])
                n_acc, token = self.rule(tested, logits[:n_test], verify_gen, bonus=False)
                kept = seq.commit(n_acc, token, tested.read)
                stats.n_pre_verify_rounds += m == 0
                stats.n_post_verify_rounds += m > 0
                stats.n_no_target_token += token is None
                discarded = n_acc + (token is not None) - kept  # committed, then cut after an EOS
                if token is not None or seq.finished:  # every untested or rejected draft is dropped
                    discarded += (m + block.k) - n_acc
                    q_pending, m = [], 0
                else:  # all tested drafts accepted: the block's rest is pending
                    q_pending, m = block.q[1:], block.k - 1
                target.rollback(seq.n - 1)
                drafter.runner.rollback(seq.n + m - 1)
                stats.add_round(block.k, n_test, n_acc, discarded, block.t1 - block.t0, t1 - t0)
                stats.overlap_time_s += max(0.0, min(block.t1, t1) - max(block.t0, t0))

        return finish(stats, seq, clock.now() - t_start, drafter.runner, target, return_caches)

    def settings(self) -> dict:
        return {"gamma": self.gamma_setting, "policy": None if self.policy is None else self.policy.name,
                **({} if self.policy is None else self.policy.settings())}
