"""The one round core of every decoder: draft a block under a stop policy, verify it with an
acceptance rule, commit with EOS, roll both caches back, count the stats.

A decoder's ``generate`` is a loop over these parts, so each one reads on one screen and none
repeats another's bookkeeping:

- :class:`Drafter`: drafts a block of candidates from the draft's
  :class:`~specdecpp.models.runner.ModelRunner` under a
  :class:`~specdecpp.stopping.policies.StopPolicy`; the policy always gets ``(k, logits, hidden, token)``.
- :class:`ExactRule`: the acceptance rule, speculative sampling's ``min(1, p/q)`` test with the
  ``(p - q)+`` residual (:func:`~specdecpp.core.verify.verify`), of the round's
  :class:`Candidates`. A lossy rule (a cascade's target ``pi``) is another object with the same
  call; a tree's node-by-node rule has its own (specdecpp/decoders/sequoia.py).
- :class:`TokenBuffer`: the committed tokens and the drafts after them in one buffer;
  :meth:`TokenBuffer.commit` writes the verified tokens, cuts at EOS (or where a caller's stop
  check says) and says what was kept.
- :class:`CallHooks`: what a caller adds to one call (``specdecpp.hf``: transformers' logits
  processors, stopping criteria and streamer); each hook left None costs nothing.
- :class:`RunStats` counts a round (:meth:`RunStats.add_round`); :func:`finish` ends a
  ``generate`` with its :class:`GenerateOutput`.
- The round's clocks (:class:`~specdecpp.core.timing.Clock`) and attention kernels
  (:func:`~specdecpp.core.attention.decoding`) live in ``core``.

Conventions: ``p`` is the TARGET's warped distribution and ``q`` the DRAFT's (see core/verify.py).
Both caches hold every committed token except the newest one, which the next forward feeds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

from ..core.sampling import (
    SamplingConfig,
    argmax,
    as_kept,
    dense_rows,
    kept_rows,
    sample,
    warp,
    warp_kept,
)
from ..core.timing import Clock
from ..core.verify import verify, verify_kept, verify_rows
from ..fast.features import warm_up_features
from ..models.loading import token_set
from ..models.runner import ModelRunner
from ..stopping.policies import StopPolicy


class _NeverStop(StopPolicy):
    """A block runs to its length (PEARL without a policy)."""

    name = "none"
    max_candidates = 1 << 30
    needs_hidden = reads_values = False

    def should_stop(self, k, logits, hidden, token=None) -> bool:
        return False


@dataclass
class Block:
    """A drafted block: ``k`` candidates written to the sequence buffer and, unless greedy, the
    k rows ``q`` [V] they were sampled from (on a CPU under top-k, :class:`~specdecpp.core.sampling.KeptProbs`:
    :func:`~specdecpp.core.sampling.dense_rows` makes them tensors). ``t0``/``t1`` bracket the drafting."""

    k: int
    q: list
    t0: float
    t1: float
    logits: list = field(default_factory=list)  # the draft's raw logits rows, with keep_logits
    extra_forwards: int = 0  # draft forwards beyond the k candidates (a cascade's peek)

    @property
    def draft_logits(self) -> torch.Tensor | None:
        return torch.stack(self.logits) if self.logits else None


@dataclass
class Candidates:
    """What an acceptance rule tests: the drafted ``tokens`` [K] and, unless greedy, the draft's
    K rows ``q`` they were sampled from (as in :class:`Block`). What only a lossy rule (a cascade) reads: the draft's
    raw ``logits`` [K, V] of the candidates (None unless the drafter kept them) and ``peek()``, the
    draft's raw logits [V] after the last candidate (one more draft forward, made only if called).
    A rule that reads the candidates' values with its verdict leaves them in ``read``, which the
    commit then takes instead of reading them again (:meth:`TokenBuffer.commit`)."""

    tokens: torch.Tensor
    q: list
    logits: torch.Tensor | None = None
    peek: Callable[[], torch.Tensor] | None = None
    read: list[int] | None = None  # the candidates' values on the host, where the rule read them with its verdict


@dataclass(frozen=True)
class CallHooks:
    """What a caller adds to one ``generate`` / ``generate_batch`` call; a hook left None costs nothing.

    - ``draft_logits`` / ``target_logits``: ``(rows, tokens, ends, logits) -> logits``, the draft's
      (target's) raw logits rows [R, V] before they are warped (q and p; a greedy argmax reads them
      too), where row r scores the token after ``tokens[r][:ends[r]]`` of the call's prompt
      ``rows[r]`` (``tokens[r]``: that row's token buffer). The stop policy reads the draft's raw rows.
    - ``stop``: ``(row, tokens, start, count) -> int | None``, after a round's verdict: the first i
      < ``count`` whose prefix ``tokens[:start + i + 1]`` ends the row (the tokens after it are cut,
      as after an EOS), or None.
    - ``committed``: ``(row, new_tokens)``, the tokens a round kept (a streamer's ``put``)."""

    draft_logits: Callable | None = None
    target_logits: Callable | None = None
    stop: Callable | None = None
    committed: Callable | None = None


def check_hooks(hooks) -> None:
    if hooks is not None and not isinstance(hooks, CallHooks):
        raise TypeError(f"hooks must be a specdecpp.decoders.rounds.CallHooks or None, got {type(hooks).__name__}")


def processed(process: Callable | None, row: int, tokens: torch.Tensor, ends: list[int],
              logits: torch.Tensor) -> torch.Tensor:
    """One row's logits rows [R, V] (row r after ``tokens[:ends[r]]``) through ``process`` (None: as they are)."""
    return logits if process is None else process([row] * len(ends), [tokens] * len(ends), ends, logits)


class Drafter:
    """Drafts candidate blocks with the draft model under a stop policy.

    Candidate ``y_k`` is drawn from ``q_k = warp(draft logits)`` (the argmax under greedy
    decoding), then the policy is asked ``should_stop(k, logits, hidden, y_k)``. EOS among the
    candidates ends a block only where the policy reads values on the host anyway (a device sync
    per candidate otherwise); else the verification's commit cuts at EOS.
    """

    def __init__(self, model, vocab: int, policy: StopPolicy | None, sampling: SamplingConfig,
                 eos: set[int], clock: Clock, keep_logits: bool = False, runners=ModelRunner) -> None:
        """``runners``: builds the draft's runner as ``runners(model, vocab, want_hidden)``, the
        eager :class:`ModelRunner` by default (the fast path's: a ``specdecpp.fast.CallRunners`` call)."""
        self.policy = policy if policy is not None else _NeverStop()
        self.keep_logits = keep_logits
        self.sampling, self.eos, self.clock = sampling, eos, clock
        self.needs_hidden = self.policy.needs_hidden
        self.stop_at_eos = bool(eos) and self.policy.reads_values
        # a draw's check is a host read: off a CPU it waits for the exact rule's one read (verify), but a
        # lossy rule (keep_logits) does not check the draft's rows, so its draws are checked here
        self.check_draws = keep_logits or torch.device(model.device).type == "cpu"
        self.runner = runners(model, vocab, self.needs_hidden)

    def __enter__(self) -> Drafter:
        self.runner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.runner.__exit__(*exc)

    def block(self, seq: torch.Tensor, start: int, count: int, gen: torch.Generator | None,
              generated: int | None = None, process: Callable | None = None) -> Block:
        """Draft at most ``count`` candidates into ``seq[start:]`` after ``seq[:start]``; ``generated``:
        the response tokens before ``start`` (``StopPolicy.begin_round``); ``process``: a
        :class:`CallHooks` ``draft_logits`` hook (row 0) for the rows q is drawn from."""
        t0 = self.clock.now()
        cfg, policy, runner, q_rows, k = self.sampling, self.policy, self.runner, [], 0
        kept_logits = []
        if not runner.ready(start):  # a feature draft before the target's first forward: nothing to read
            count = 0
        policy.begin_round(generated)
        while k < count:
            logits, hidden = runner.feed(seq[runner.length : start + k])
            last = logits[-1]  # one view for the draw, the policy and a lossy rule (each op counts on a CPU)
            scores = last if process is None else processed(process, 0, seq, [start + k], logits[-1:])[0]
            if cfg.greedy:  # the argmax (the first of ties); no q needed
                y = argmax(scores)
            else:  # sample(warp(scores)); on a CPU under top-k the row is kept sparse
                q_k = warp_kept(scores, cfg)
                if q_k is None:
                    q_k = warp(scores, cfg)
                    y = sample(q_k, gen, check=self.check_draws)
                else:
                    y = torch.tensor(q_k.draw(gen))  # the policies read a token tensor
                q_rows.append(q_k)
            seq[start + k] = y
            if self.keep_logits:
                kept_logits.append(last)
            k += 1
            if policy.should_stop(k, last, hidden[-1] if self.needs_hidden else None, y) or \
                    (self.stop_at_eos and int(y) in self.eos):
                break
        return Block(k, q_rows, t0, self.clock.now(), kept_logits)

    def candidates(self, block: Block, seq: torch.Tensor, start: int) -> Candidates:
        """The block's candidates ``seq[start : start + k]`` as a rule reads them."""
        end = start + block.k
        return Candidates(seq[start:end], block.q, block.draft_logits, partial(self.peek, block, seq, end))

    def peek(self, block: Block, seq: torch.Tensor, end: int) -> torch.Tensor:
        """The draft's raw logits at position ``end`` (after ``seq[:end]``): one more forward,
        counted in ``block.extra_forwards`` (a cascade's bonus token needs the draft's q there)."""
        block.extra_forwards += 1
        return self.runner.feed(seq[self.runner.length : end])[0][-1]


class ExactRule:
    """Speculative sampling's exact acceptance rule: accept ``y_i`` with ``min(1, p_i(y_i) /
    q_i(y_i))``, resample a rejection from ``Norm[(p_i - q_i)+]`` (greedy: accept iff ``y_i`` is the
    target's argmax). The output has exactly the target's warped distribution.

    ``__call__(candidates, target logits [K (+1), V], generator, bonus)`` returns
    ``(n_accepted, next_token)`` (``next_token`` None when every candidate is accepted and
    ``bonus=False``); another rule (a cascade's lossy target) is an object with the same call and
    its own ``lossy`` flag (True: the drafter keeps the raw logits a :class:`Candidates` carries)."""

    lossy = False
    name = "exact"

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling

    def __call__(self, drafted: Candidates, logits: torch.Tensor, gen: torch.Generator | None,
                 bonus: bool = True) -> tuple[int, int | None]:
        drafted.read = []  # the candidates' values, read with the verdict (the commit reads none)
        if self.sampling.greedy:  # argmax of the logits = argmax of the one-hot warp
            return verify(drafted.tokens, None, logits, greedy=True, bonus=bonus, drafts_out=drafted.read)
        cfg = self.sampling
        if logits.device.type == "cpu":  # the same verdict, warping only the rows up to the first rejection
            drafted.read = drafted.tokens.tolist()  # on a CPU a read waits for nothing
            if kept_rows(logits.shape[-1], cfg, logits.device):  # and every row kept sparse (top-k)
                return verify_kept(drafted.read, as_kept(drafted.q),
                                   lambda i: warp_kept(logits[i], cfg), logits.shape[0], gen, bonus)
            return verify_rows(drafted.tokens, dense_rows(drafted.q), lambda i: warp(logits[i], cfg), logits.shape[0],
                               gen, bonus)
        p = warp(logits, cfg)
        q = torch.stack(dense_rows(drafted.q)) if drafted.q else p.new_zeros((0, p.shape[-1]))
        return verify(drafted.tokens, q, p, gen, bonus=bonus, drafts_out=drafted.read if drafted.q else None)


class TokenBuffer:
    """The committed tokens ``tokens[:n]`` and any drafts after them, in one buffer of room for
    the prompt plus ``max_new_tokens`` plus one."""

    def __init__(self, prompt_ids: torch.Tensor, max_new_tokens: int,
                 eos_token_id: int | Iterable[int] | None, device: torch.device, row: int = 0,
                 hooks: CallHooks | None = None) -> None:
        """``row``: the prompt's index in its call (what ``hooks`` are told)."""
        self.row, self.hooks = row, hooks
        self.prompt_len = prompt_ids.shape[-1]
        self.end = self.prompt_len + max_new_tokens  # no token is committed at or beyond it
        self.eos = token_set(eos_token_id)
        self.tokens = torch.empty(self.end + 1, dtype=torch.long, device=device)
        self.tokens[: self.prompt_len] = prompt_ids.reshape(-1)
        self.n = self.prompt_len
        self.finished = False

    @property
    def n_generated(self) -> int:
        return self.n - self.prompt_len

    @property
    def room(self) -> int:
        """Tokens that may still be committed."""
        return self.end - self.n

    def commit(self, n_accepted: int, token: int | None, drafted: list[int] | None = None,
               written: bool = False) -> int:
        """Commit the first ``n_accepted`` drafts after ``n`` and then ``token`` (None: no token
        from the target this round, as in PEARL's fully accepted rounds). Everything after an EOS,
        or after the first prefix the ``stop`` hook ends, is cut and ends the sequence. Returns how
        many tokens were kept (told to the ``committed`` hook). ``drafted``: the drafts' values as
        the rule read them (:attr:`Candidates.read`), at least ``n_accepted`` of them; then the
        buffer is not read back (on CUDA a synchronisation saved), else it is. ``written``: the buffer
        holds ``token`` already (a captured round wrote it). The token is written by a fill (on CUDA a
        kernel with the value as its argument): an assignment of a Python int copies a host tensor to
        the device, which waits for the stream (a synchronisation per round)."""
        if token is not None and not written:
            self.tokens.narrow(0, self.n + n_accepted, 1).fill_(token)
        if drafted is not None and len(drafted) >= n_accepted:
            new = [*drafted[:n_accepted], *(() if token is None else (token,))]
        else:
            new = self.tokens[self.n : self.n + n_accepted + (token is not None)].tolist()
        hit = next((i for i, t in enumerate(new) if t in self.eos), None)
        hooks = self.hooks
        before = len(new) if hit is None else hit  # the tokens before an EOS, which ends the row anyway
        if hooks is not None and hooks.stop is not None and before:
            cut = hooks.stop(self.row, self.tokens, self.n, before)
            hit = hit if cut is None else cut
        kept = len(new) if hit is None else hit + 1
        self.n += kept
        self.finished = hit is not None or self.n >= self.end
        if hooks is not None and hooks.committed is not None and kept:
            hooks.committed(self.row, self.tokens[self.n - kept : self.n])
        return kept

    def output(self) -> torch.Tensor:
        return self.tokens[: self.n].unsqueeze(0).clone()


def check_generate_args(prompt_ids, max_new_tokens, models=None) -> None:
    """The argument checks every decoder's ``generate`` shares. ``models``: the ``(draft, target)``
    pair, whose input vocabularies every prompt id must lie in (:func:`check_token_ids`)."""
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must be a LongTensor of shape [1, L], got "
                         f"{getattr(prompt_ids, 'shape', type(prompt_ids).__name__)}")
    if prompt_ids.shape[1] == 0:
        raise ValueError("prompt_ids is empty: give at least one prompt token (e.g. BOS)")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if models is not None:
        check_token_ids(prompt_ids, models)


def input_vocab_size(model) -> int | None:
    """The token ids ``model`` embeds (its input embedding's rows; None: it does not say)."""
    layer = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    size = getattr(layer, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if size else None


def check_token_ids(prompt_ids: torch.Tensor, models, name: str = "prompt_ids") -> None:
    """Every id of ``prompt_ids`` ([1, L], or one batch row [L]) is a token both models of ``models``
    (draft, target) embed: an integer in [0, V) for the smaller input vocabulary V; otherwise a
    ValueError naming the first bad id, its position and the vocabulary sizes (rather than an
    embedding's IndexError)."""
    if prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex or prompt_ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids (a LongTensor), got dtype {prompt_ids.dtype}")
    sizes = {role: input_vocab_size(m) for role, m in zip(("draft", "target"), models, strict=True)}
    sizes = {role: v for role, v in sizes.items() if v is not None}
    if not sizes:
        return
    vocab = min(sizes.values())
    bad = ((prompt_ids < 0) | (prompt_ids >= vocab)).nonzero()
    if len(bad):  # one host read per call, before any forward
        where = tuple(int(i) for i in bad[0])
        sizes_said = ", ".join(f"{role} {v}" for role, v in sizes.items())
        raise ValueError(f"{name}[{', '.join(map(str, where))}] = {int(prompt_ids[where])} is not a token id of the "
                         f"models: ids run 0..{vocab - 1} (vocabulary sizes: {sizes_said}); {len(bad)} id(s) of "
                         f"{name} are outside it. Tokenize the prompt with the pair's tokenizer")


def device_generator(generator: torch.Generator | None, device: torch.device):
    """Sampling happens on the models' device; derive a generator there deterministically."""
    if generator is None or generator.device.type == device.type:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device).manual_seed(seed)


def start_generate(prompt_ids, max_new_tokens, eos_token_id, generator: torch.Generator | None,
                   device: torch.device, profile: bool,
                   hooks: CallHooks | None = None,
                   models=None) -> tuple[torch.Generator | None, Clock, Clock, TokenBuffer]:
    """The opening of a one-generator ``generate``: the argument checks (the prompt's ids against
    ``models``, the decoder's ``(draft, target)``), the generator on the models' device, the call's
    clock (synchronised), the round marks (``sync=profile``) and the prompt's :class:`TokenBuffer`
    (row 0, with the call's ``hooks``)."""
    check_generate_args(prompt_ids, max_new_tokens, models)
    check_hooks(hooks)
    return (device_generator(generator, device), Clock(device), Clock(device, sync=profile),
            TokenBuffer(prompt_ids, max_new_tokens, eos_token_id, device, hooks=hooks))


def check_pair_devices(draft, target) -> torch.device:
    if draft.device != target.device:
        raise ValueError(f"draft is on {draft.device} but target on {target.device}; load them on one device")
    return target.device


@dataclass
class RunStats:
    """What one ``generate`` call did. ``accept_lengths[r]`` is the number of draft candidates
    accepted in round r (the round also emits one target token); ``candidate_lengths[r]`` is the
    number K of candidates drafted in round r. N_draft + N_target = N + N_discarded holds exactly
    (paper, Section 2): a round that ends on EOS counts the tokens after the EOS as discarded."""

    n_generated: int = 0
    n_target_calls: int = 0
    n_draft_calls: int = 0
    n_discarded: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    candidate_lengths: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0
    replayed_rounds: int = 0  # rounds replayed as one CUDA graph (specdecpp/decoders/captured.py)
    first_round_s: float = float("nan")  # the first round's wall time, the prefill's forwards included (chain decoders)

    @property
    def discard_rate(self) -> float:
        return self.n_discarded / max(self.n_generated, 1)

    @property
    def verification_rate(self) -> float:
        return self.n_target_calls / max(self.n_generated, 1)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def tokens_per_s(self) -> float:
        return self.n_generated / self.wall_time_s if self.wall_time_s > 0 else float("nan")

    def to_dict(self) -> dict:
        return asdict(self)

    def add_round(self, drafted: int, tested: int, accepted: int, discarded: int,
                  draft_s: float, target_s: float) -> None:
        """Count one round: ``drafted`` draft forwards, one target forward that tested ``tested``
        candidates and accepted ``accepted`` of them, ``discarded`` tokens computed but not kept."""
        self.n_draft_calls += drafted
        self.n_target_calls += 1
        self.n_discarded += discarded
        self.accept_lengths.append(accepted)
        self.candidate_lengths.append(tested)
        self.draft_time_s += draft_s
        self.target_time_s += target_s


@dataclass
class GenerateOutput:
    tokens: torch.Tensor  # [1, L + n]: the prompt, then the n generated tokens
    stats: RunStats
    caches: dict | None = None  # {"draft": Cache, "target": Cache} when return_caches=True
    batch_size: int = 1  # rows that shared the forwards (generate_batch's batch_size)
    # generate_batch: the call's rounds as (rows, longest K, draft forwards), shared by its rows
    batch_rounds: list | None = None


def finish(stats: RunStats, seq: TokenBuffer, wall_time_s: float, draft: ModelRunner,
           target: ModelRunner, return_caches: bool) -> GenerateOutput:
    """The end of every decoder's ``generate``: the totals and the output."""
    stats.wall_time_s = wall_time_s
    stats.n_generated = seq.n_generated
    caches = {"draft": draft.kept_cache(), "target": target.kept_cache()} if return_caches else None
    return GenerateOutput(tokens=seq.output(), stats=stats, caches=caches)


class FastPlanned:
    """A decoder whose ``fast_plan(prompt_len, max_new_tokens)`` says the tokens a call holds and
    each model's buckets, over its ``runners`` (:class:`~specdecpp.fast.CallRunners`);
    ``drafts``: whether its draft runs any forward (not under target-only decoding)."""

    drafts = True

    def warm_up(self, prompt_len: int, max_new_tokens: int, batch_size: int | None = None,
                progress: bool = False) -> float:
        """Size the fast path for calls up to this long and compile every bucket they use
        (fast='compile'), so no later call compiles; the seconds it took (0 without compiling).
        ``batch_size``: those of ``generate_batch`` calls of at most that many rows at once;
        ``progress``: a progress bar over the steps compiled or captured. A decoder whose draft
        runs no forward (``drafts`` false) compiles none of the draft's buckets; a feature pair's
        (``feature``) compiles its target's feature steps, its draft running eagerly
        (specdecpp.fast.features)."""
        tokens, plan = self.fast_plan(prompt_len, max_new_tokens)
        if getattr(self, "feature", False):
            return warm_up_features(self.draft, self.target, self.runners, tokens, plan[-1][1], batch_size, progress)
        if not self.drafts:
            plan = [(model, buckets) for model, buckets in plan if model is not self.draft]
        return self.runners.warm_up(tokens, plan, rows=batch_size, progress=progress)
