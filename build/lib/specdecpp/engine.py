"""One decoding loop for every stop policy: draft candidates, verify them in one target pass,
roll both KV caches back to the accepted prefix."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from .hooks import FinalHidden, keep_last, new_cache
from .loading import token_set
from .policies import StopPolicy
from .reduced_vocab import output_vocab_size
from .sampling import SamplingConfig, sample, warp
from .verify import verify


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


@dataclass
class GenerateOutput:
    tokens: torch.Tensor  # [1, L + n]: the prompt, then the n generated tokens
    stats: RunStats
    caches: dict | None = None  # {"draft": Cache, "target": Cache} when return_caches=True


# Token counts a CPU forward is padded to (a multiple of; see _Runner.feed). 1 turns padding off.
CPU_TOKEN_MULTIPLE = 4


class _Runner:
    """One model and its KV cache. ``length`` tokens are cached; rollback = crop. With
    ``want_hidden`` the final hidden state is captured by a hook (:class:`FinalHidden`), never
    every layer's; use it as a context manager so the hook is removed."""

    def __init__(self, model, vocab: int, want_hidden: bool) -> None:
        self.model, self.vocab, self.want_hidden = model, vocab, want_hidden
        self.cache = new_cache(model)
        self.final = FinalHidden(model) if want_hidden else None

    def __enter__(self) -> _Runner:
        if self.final is not None:
            self.final.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.final is not None:
            self.final.__exit__(*exc)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def feed(self, ids: torch.Tensor, n_logits: int = 1):
        """Append ``ids`` [n] to the cache; return logits [n_logits, V] (and hidden [n_logits, H]).

        On CPU, n > 1 tokens are padded to a multiple of ``CPU_TOKEN_MULTIPLE`` with copies of the
        last token, which are cropped from the cache again: the CPU GEMM kernels are slower for 2-3
        rows than for 4 (and 5-7 than 8), so an unpadded forward over 2-3 tokens costs more than
        over 4 (scripts/bench_verify_cost.py). Causal attention keeps the real positions exact."""
        n = ids.shape[0]
        pad = (-n) % CPU_TOKEN_MULTIPLE if n > 1 and ids.device.type == "cpu" else 0
        if pad:
            ids = torch.cat([ids, ids[-1:].expand(pad)])
        kwargs = self.final.kwargs if self.final is not None else {}
        out = self.model(ids.unsqueeze(0), past_key_values=self.cache, use_cache=True,
                         logits_to_keep=keep_last(n + pad, n_logits + pad, ids.device), **kwargs)
        end = out.logits.shape[1] - pad
        logits = out.logits[0, end - n_logits : end, : self.vocab]
        hidden = self.final.take(out)[0, -n_logits - pad :][:n_logits] if self.final is not None else None
        if pad:
            self.cache.crop(-pad)
        return logits, hidden

    def rollback(self, length: int) -> None:
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)


def check_generate_args(prompt_ids, max_new_tokens) -> None:
    """The argument checks every decoder's ``generate`` shares."""
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must be a LongTensor of shape [1, L], got "
                         f"{getattr(prompt_ids, 'shape', type(prompt_ids).__name__)}")
    if prompt_ids.shape[1] == 0:
        raise ValueError("prompt_ids is empty: give at least one prompt token (e.g. BOS)")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def _device_generator(generator: torch.Generator | None, device: torch.device):
    """Sampling happens on the models' device; derive a generator there deterministically."""
    if generator is None or generator.device.type == device.type:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device).manual_seed(seed)


class Clock:
    """perf_counter, after synchronising CUDA so that queued kernels are counted. ``sync=False``
    on CUDA reads the time without waiting (only meaningful around a final synchronised mark);
    ``exact`` tells whether a reading counts the queued work (always on CPU)."""

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.sync = sync

    @property
    def exact(self) -> bool:
        return self.sync or not self.cuda

    def now(self) -> float:
        if self.cuda and self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


class SpeculativeDecoder:
    """Speculative decoding of one prompt (batch 1) with any :class:`StopPolicy`.

    Both caches hold every committed token except the newest one, which is fed at the start of
    the next round. Lossless: greedy output equals the target's greedy decoding; sampled output
    has the target's warped distribution, whatever the policy.
    """

    def __init__(self, draft, target, policy: StopPolicy, sampling: SamplingConfig | None = None,
                 profile: bool = False) -> None:
        """``profile=True`` synchronises CUDA around every round's draft and target phases so that
        ``draft_time_s``/``target_time_s`` are measured; without it a CUDA run synchronises only for
        the wall time and reports those two as NaN (on CPU they are measured either way)."""
        if not isinstance(policy, StopPolicy):
            raise TypeError(f"policy must be a StopPolicy (FixedK, SVIP, SpecDecPP, TargetOnly), got {type(policy).__name__}")
        self.draft, self.target, self.policy, self.profile = draft, target, policy, profile
        self.sampling = sampling or SamplingConfig()
        self.vocab = min(output_vocab_size(draft), output_vocab_size(target))
        self.device = target.device
        if draft.device != self.device:
            raise ValueError(f"draft is on {draft.device} but target on {self.device}; load them on one device")
        policy.bind(draft, self.sampling.temperature)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int = 128,
                 generator: torch.Generator | None = None,
                 eos_token_id: int | Iterable[int] | None = None,
                 return_caches: bool = False) -> GenerateOutput:
        check_generate_args(prompt_ids, max_new_tokens)
        eos = token_set(eos_token_id)
        gen = _device_generator(generator, self.device)
        cfg, policy = self.sampling, self.policy
        clock, marks = Clock(self.device), Clock(self.device, sync=self.profile)
        needs_hidden = policy.needs_hidden
        # EOS among the candidates: checked per candidate only where the policy reads values on the
        # host anyway (a sync per candidate on GPU otherwise); else the verification cuts at EOS,
        # at the cost of the last round's candidates after it.
        eos_per_candidate = bool(eos) and policy.reads_values
        draft = _Runner(self.draft, self.vocab, want_hidden=needs_hidden)
        target = _Runner(self.target, self.vocab, want_hidden=False)
        stats = RunStats()
        prompt_len = prompt_ids.shape[1]
        seq = torch.empty(prompt_len + max_new_tokens + 1, dtype=torch.long, device=self.device)
        seq[:prompt_len] = prompt_ids[0]
        n = prompt_len  # committed tokens; seq[n - 1] is not yet in either cache
        t_start = clock.now()

        with draft:
            while n - prompt_len < max_new_tokens:
                k_max = min(policy.max_candidates, max_new_tokens - (n - prompt_len) - 1)
                policy.new_round()
                t0 = marks.now()
                q_rows, k = [], 0
                while k < k_max:  # draft y_1..y_K, each from q_k = draft(prefix, y_<k)
                    logits, hidden = draft.feed(seq[draft.length : n + k])
                    if cfg.greedy:  # the argmax; verification needs no q
                        y = logits[-1].argmax(-1)
                    else:
                        q_k = warp(logits[-1], cfg)
                        y = sample(q_k, gen)
                        q_rows.append(q_k)
                    seq[n + k] = y
                    k += 1
                    if policy.should_stop(k, logits[-1], hidden[-1] if needs_hidden else None, y) or \
                            (eos_per_candidate and int(y) in eos):
                        break
                t1 = marks.now()
                logits = target.feed(seq[target.length : n + k], n_logits=k + 1)[0]  # p_1..p_{K+1}
                if cfg.greedy:  # argmax of the logits = argmax of the one-hot warp
                    n_acc, next_token = verify(seq[n : n + k], None, logits, gen, greedy=True)
                else:
                    p = warp(logits, cfg)
                    q = torch.stack(q_rows) if q_rows else p.new_zeros((0, p.shape[-1]))
                    n_acc, next_token = verify(seq[n : n + k], q, p, gen)
                seq[n + n_acc] = next_token
                t2 = marks.now()

                new = seq[n : n + n_acc + 1].tolist()
                hit_eos = next((i for i, t in enumerate(new) if t in eos), None)
                kept = len(new) if hit_eos is None else hit_eos + 1
                n += kept
                target.rollback(n - 1)
                draft.rollback(min(draft.length, n - 1))

                stats.n_draft_calls += k
                stats.n_target_calls += 1
                stats.n_discarded += k + 1 - kept  # k - n_acc, plus tokens cut after an EOS
                stats.accept_lengths.append(n_acc)
                stats.candidate_lengths.append(k)
                stats.draft_time_s += t1 - t0
                stats.target_time_s += t2 - t1
                if hit_eos is not None:
                    break

        if not marks.exact:
            stats.draft_time_s = stats.target_time_s = float("nan")
        stats.wall_time_s = clock.now() - t_start
        stats.n_generated = n - prompt_len
        return GenerateOutput(tokens=seq[:n].unsqueeze(0).clone(), stats=stats,
                              caches={"draft": draft.cache, "target": target.cache} if return_caches else None)
