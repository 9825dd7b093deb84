"""The one round core of every decoder: draft a block under a stop policy, verify it with an
acceptance rule, commit with EOS, roll both caches back, count the stats.

A decoder's ``generate`` is a loop over these parts, so each one reads on one screen and none
repeats another's bookkeeping:

- :class:`ModelRunner`: one model and its KV cache (feed tokens, roll back by cropping).
- :class:`Drafter`: drafts a block of candidates from the draft runner under a
  :class:`~specdecpp.policies.StopPolicy`; the policy always gets ``(k, logits, hidden, token)``.
- :class:`ExactRule`: the acceptance rule, speculative sampling's ``min(1, p/q)`` test with the
  ``(p - q)+`` residual (:func:`~specdecpp.verify.verify`). A lossy rule (a cascade's target
  ``pi``) or a tree's node-by-node rule is another object with the same call.
- :class:`Sequence`: the committed tokens and the drafts after them in one buffer;
  :meth:`Sequence.commit` writes the verified tokens, cuts at EOS and says what was kept.
- :meth:`RunStats.add_round <specdecpp.engine.RunStats.add_round>` counts a round.
- :class:`Clock`: wall time with CUDA synchronised where a reading must count queued kernels.
- :func:`decode_attention` / :func:`decoding`: the attention kernels a decoder's forwards use on
  CUDA (not cuDNN's, which builds a plan for every new query/key length).

Conventions: ``p`` is the TARGET's warped distribution and ``q`` the DRAFT's (see verify.py).
Both caches hold every committed token except the newest one, which the next forward feeds.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .compat import cache_kwargs
from .hooks import FinalHidden, keep_last, new_cache
from .loading import token_set
from .policies import StopPolicy
from .sampling import SamplingConfig, sample, warp
from .verify import verify

# Token counts a CPU forward is padded to (a multiple of; see ModelRunner.feed). 1 turns padding off.
CPU_TOKEN_MULTIPLE = 4


class HiddenHook:
    """A runner's final-hidden-state hook (``self.final``, a :class:`FinalHidden` or None) as a
    context manager, so the hook is removed when the runner is done (chain and batch runners)."""

    final: FinalHidden | None = None

    def __enter__(self):
        if self.final is not None:
            self.final.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.final is not None:
            self.final.__exit__(*exc)


class ModelRunner(HiddenHook):
    """One model and its KV cache. ``length`` tokens are cached; rollback = crop. With
    ``want_hidden`` the final hidden state is captured by a hook (:class:`FinalHidden`), never
    every layer's; use it as a context manager so the hook is removed."""

    def __init__(self, model, vocab: int, want_hidden: bool) -> None:
        self.model, self.vocab, self.want_hidden = model, vocab, want_hidden
        self.cache = new_cache(model)
        self.final = FinalHidden(model) if want_hidden else None

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def feed(self, ids: torch.Tensor, n_logits: int = 1, position_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None):
        """Append ``ids`` [n] to the cache; return logits [n_logits, V] (and hidden [n_logits, H]).

        By default the new tokens follow the cache causally. A token tree passes ``position_ids``
        [n] and ``attention_mask``, a boolean [n, length + n] (True: the row's token may attend to
        that cache position or new token), which is given to the model as a 4-D additive mask.

        On CPU, n > 1 tokens are padded to a multiple of ``CPU_TOKEN_MULTIPLE`` with copies of the
        last token, which are cropped from the cache again: the CPU GEMM kernels are slower for 2-3
        rows than for 4 (and 5-7 than 8), so an unpadded forward over 2-3 tokens costs more than
        over 4 (scripts/bench_verify_cost.py). Causal attention keeps the real positions exact (with
        a mask, no real token attends to the padding)."""
        n = ids.shape[0]
        pad = (-n) % CPU_TOKEN_MULTIPLE if n > 1 and ids.device.type == "cpu" else 0
        if pad:
            ids = torch.cat([ids, ids[-1:].expand(pad)])
        kwargs = dict(self.final.kwargs) if self.final is not None else {}
        if position_ids is not None:
            kwargs["position_ids"] = torch.cat([position_ids, position_ids[-1:].expand(pad)]).unsqueeze(0)
        if attention_mask is not None:
            kwargs["attention_mask"] = self._mask4d(attention_mask, pad)
        out = self.model(ids.unsqueeze(0), use_cache=True, **cache_kwargs(self.model, self.cache),
                         logits_to_keep=keep_last(n + pad, n_logits + pad, ids.device), **kwargs)
        end = out.logits.shape[1] - pad
        logits = out.logits[0, end - n_logits : end, : self.vocab]
        hidden = self.final.take(out)[0, -n_logits - pad :][:n_logits] if self.final is not None else None
        if pad:
            self.cache.crop(-pad)
        return logits, hidden

    def _mask4d(self, allowed: torch.Tensor, pad: int) -> torch.Tensor:
        """A boolean [n, length + n] mask as the model's 4-D additive one [1, 1, n + pad, length +
        n + pad]: padding rows repeat the last real row and see themselves; no real row sees them."""
        n, width = allowed.shape
        if width != self.length + n:
            raise ValueError(f"attention_mask must be [n, cached + n] = [{n}, {self.length + n}], got {tuple(allowed.shape)}")
        if pad:
            allowed = torch.cat([allowed, allowed[-1:].expand(pad, width)])
            allowed = torch.cat([allowed, torch.eye(n + pad, dtype=torch.bool, device=allowed.device)[:, n:]], dim=1)
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]

    def compact(self, keep) -> None:
        """Keep only the cached positions ``keep`` (strictly increasing), in that order: a token
        tree's accepted path moves next to the prefix. Positions before the first gap stay put."""
        keep = [int(k) for k in keep]
        if any(b <= a for a, b in zip(keep, keep[1:], strict=False)) or (keep and (keep[0] < 0 or keep[-1] >= self.length)):
            raise ValueError(f"compact: keep must be strictly increasing cache positions < {self.length}, got {keep}")
        first = next((i for i, k in enumerate(keep) if k != i), len(keep))
        if first < len(keep):
            src = torch.tensor(keep[first:], device=self.cache.layers[0].keys.device)
            for layer in self.cache.layers:
                check_plain_layer(layer)
                for name in ("keys", "values"):
                    kv = getattr(layer, name)
                    kv[..., first : len(keep), :] = kv.index_select(-2, src)
        self.rollback(len(keep))

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (no-op if fewer are cached)."""
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)


def check_plain_layer(layer) -> None:
    """Compaction rewrites a cache layer's ``keys``/``values`` in place, which is right for
    transformers' plain ``DynamicLayer`` only (a sliding window or an indexed layer keeps more)."""
    from transformers.cache_utils import DynamicLayer

    plain = isinstance(layer, DynamicLayer) and all(
        getattr(type(layer), m) is getattr(DynamicLayer, m) for m in ("crop", "get_seq_length", "update"))
    if not plain:
        raise ValueError(f"this model's KV cache has {type(layer).__name__} layers; a token tree needs transformers' "
                         "plain DynamicLayer (no sliding window, no hybrid or indexed layers)")


class Clock:
    """perf_counter, after synchronising the calling thread's CUDA stream so that its queued
    kernels are counted (a second thread's stream is left alone). ``sync=False`` on CUDA reads the
    time without waiting (only meaningful around a final synchronised mark); ``exact`` tells
    whether a reading counts the queued work (always on CPU)."""

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.sync = sync

    @property
    def exact(self) -> bool:
        return self.sync or not self.cuda

    def now(self) -> float:
        if self.cuda and self.sync:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()


# Which scaled-dot-product-attention kernels decoding may use on CUDA (environment variable):
# "no-cudnn" (default) or "default" (PyTorch's own choice, cuDNN's kernel first on recent GPUs).
SDPA_ENV = "SPECDECPP_SDPA"
SDPA_CHOICES = ("no-cudnn", "default")


def decode_attention(device) -> contextlib.AbstractContextManager:
    """The attention kernels for decoding on ``device``: on CUDA, flash, memory-efficient or math
    attention, not cuDNN's. PyTorch prefers cuDNN's kernel on Hopper GPUs, and it builds (and
    caches) an execution plan for every new query and key length: speculative decoding meets a new
    pair in nearly every forward (the key length grows by a round's accepted tokens, the query
    length is the round's K + 1), so each first visit costs milliseconds of host time, and a method
    run after another that already visited the same lengths looks faster than it is
    (docs/gpu.md, "Fixed K on CUDA"). Set ``SPECDECPP_SDPA=default`` to leave the choice to
    PyTorch. A no-op on CPU. The flags are process-wide while the context is open (PEARL's
    drafting thread sees them too)."""
    choice = os.environ.get(SDPA_ENV, SDPA_CHOICES[0])
    if choice not in SDPA_CHOICES:
        raise ValueError(f"{SDPA_ENV} must be one of {', '.join(SDPA_CHOICES)}, got {choice!r}")
    if torch.device(device).type != "cuda" or choice == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def decoding(method):
    """Decorator for a decoder's ``generate``: runs it under :func:`decode_attention` of the
    decoder's ``self.device``."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with decode_attention(self.device):
            return method(self, *args, **kwargs)

    return run


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
    rows ``q`` [k, V] they were sampled from. ``t0``/``t1`` bracket the drafting."""

    k: int
    q: list
    t0: float
    t1: float
    logits: list = field(default_factory=list)  # the draft's raw logits rows, with keep_logits
    extra_forwards: int = 0  # draft forwards beyond the k candidates (a cascade's peek)

    @property
    def draft_logits(self) -> torch.Tensor | None:
        return torch.stack(self.logits) if self.logits else None


class Drafter:
    """Drafts candidate blocks with the draft model under a stop policy.

    Candidate ``y_k`` is drawn from ``q_k = warp(draft logits)`` (the argmax under greedy
    decoding), then the policy is asked ``should_stop(k, logits, hidden, y_k)``. EOS among the
    candidates ends a block only where the policy reads values on the host anyway (a device sync
    per candidate otherwise); else the verification's commit cuts at EOS.
    """

    def __init__(self, model, vocab: int, policy: StopPolicy | None, sampling: SamplingConfig,
                 eos: set[int], clock: Clock, keep_logits: bool = False) -> None:
        self.policy = policy if policy is not None else _NeverStop()
        self.keep_logits = keep_logits
        self.sampling, self.eos, self.clock = sampling, eos, clock
        self.needs_hidden = self.policy.needs_hidden
        self.stop_at_eos = bool(eos) and self.policy.reads_values
        self.runner = ModelRunner(model, vocab, want_hidden=self.needs_hidden)

    def __enter__(self) -> Drafter:
        self.runner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.runner.__exit__(*exc)

    def block(self, seq: torch.Tensor, start: int, count: int, gen: torch.Generator | None,
              generated: int | None = None) -> Block:
        """Draft at most ``count`` candidates into ``seq[start:]`` after ``seq[:start]``; ``generated``:
        the response tokens before ``start`` (``StopPolicy.begin_round``)."""
        t0 = self.clock.now()
        cfg, policy, runner, q_rows, k = self.sampling, self.policy, self.runner, [], 0
        kept_logits = []
        policy.begin_round(generated)
        while k < count:
            logits, hidden = runner.feed(seq[runner.length : start + k])
            if cfg.greedy:  # the argmax; verification needs no q
                y = logits[-1].argmax(-1)
            else:
                q_k = warp(logits[-1], cfg)
                y = sample(q_k, gen)
                q_rows.append(q_k)
            seq[start + k] = y
            if self.keep_logits:
                kept_logits.append(logits[-1])
            k += 1
            if policy.should_stop(k, logits[-1], hidden[-1] if self.needs_hidden else None, y) or \
                    (self.stop_at_eos and int(y) in self.eos):
                break
        return Block(k, q_rows, t0, self.clock.now(), kept_logits)

    def peek(self, block: Block, seq: torch.Tensor, end: int) -> torch.Tensor:
        """The draft's raw logits at position ``end`` (after ``seq[:end]``): one more forward,
        counted in ``block.extra_forwards`` (a cascade's bonus token needs the draft's q there)."""
        block.extra_forwards += 1
        return self.runner.feed(seq[self.runner.length : end])[0][-1]


class ExactRule:
    """Speculative sampling's exact acceptance rule: accept ``y_i`` with ``min(1, p_i(y_i) /
    q_i(y_i))``, resample a rejection from ``Norm[(p_i - q_i)+]`` (greedy: accept iff ``y_i`` is the
    target's argmax). The output has exactly the target's warped distribution.

    ``__call__(tokens [K], q rows, target logits [K (+1), V], generator, bonus)`` returns
    ``(n_accepted, next_token)``; another rule (a cascade's lossy target, a tree's node-by-node
    test) is an object with the same call and its own ``lossy`` flag."""

    lossy = False
    name = "exact"

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling

    def __call__(self, tokens: torch.Tensor, q_rows: list, logits: torch.Tensor,
                 gen: torch.Generator | None, bonus: bool = True, draft_logits=None,
                 peek=None) -> tuple[int, int | None]:
        """``draft_logits`` and ``peek`` (what a lossy rule may need) are not read here."""
        if self.sampling.greedy:  # argmax of the logits = argmax of the one-hot warp
            return verify(tokens, None, logits, greedy=True, bonus=bonus)
        p = warp(logits, self.sampling)
        q = torch.stack(q_rows) if q_rows else p.new_zeros((0, p.shape[-1]))
        return verify(tokens, q, p, gen, bonus=bonus)


class Sequence:
    """The committed tokens ``tokens[:n]`` and any drafts after them, in one buffer of room for
    the prompt plus ``max_new_tokens`` plus one."""

    def __init__(self, prompt_ids: torch.Tensor, max_new_tokens: int,
                 eos_token_id: int | Iterable[int] | None, device: torch.device) -> None:
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

    def commit(self, n_accepted: int, token: int | None) -> int:
        """Commit the first ``n_accepted`` drafts after ``n`` and then ``token`` (None: no token
        from the target this round, as in PEARL's fully accepted rounds). Everything after an EOS
        is cut and ends the sequence. Returns how many tokens were kept."""
        if token is not None:
            self.tokens[self.n + n_accepted] = token
        new = self.tokens[self.n : self.n + n_accepted + (token is not None)].tolist()
        hit = next((i for i, t in enumerate(new) if t in self.eos), None)
        kept = len(new) if hit is None else hit + 1
        self.n += kept
        self.finished = hit is not None or self.n >= self.end
        return kept

    def output(self) -> torch.Tensor:
        return self.tokens[: self.n].unsqueeze(0).clone()


def check_generate_args(prompt_ids, max_new_tokens) -> None:
    """The argument checks every decoder's ``generate`` shares."""
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must be a LongTensor of shape [1, L], got "
                         f"{getattr(prompt_ids, 'shape', type(prompt_ids).__name__)}")
    if prompt_ids.shape[1] == 0:
        raise ValueError("prompt_ids is empty: give at least one prompt token (e.g. BOS)")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def device_generator(generator: torch.Generator | None, device: torch.device):
    """Sampling happens on the models' device; derive a generator there deterministically."""
    if generator is None or generator.device.type == device.type:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device).manual_seed(seed)


def start_generate(prompt_ids, max_new_tokens, generator: torch.Generator | None, device: torch.device,
                   profile: bool) -> tuple[torch.Generator | None, Clock, Clock]:
    """The opening of a one-generator ``generate``: the argument checks, the generator on the
    models' device, the call's clock (synchronised) and the round marks (``sync=profile``)."""
    check_generate_args(prompt_ids, max_new_tokens)
    return device_generator(generator, device), Clock(device), Clock(device, sync=profile)


def check_pair_devices(draft, target) -> torch.device:
    if draft.device != target.device:
        raise ValueError(f"draft is on {draft.device} but target on {target.device}; load them on one device")
    return target.device
