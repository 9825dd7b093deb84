"""Speculative cascades (Narasimhan et al., "Faster Cascades via Speculative Decoding"): LOSSY,
opt-in decoding whose output follows a target ``pi`` that mixes the draft's ``q`` and the target's
``p`` under a deferral rule, so that confident draft tokens pass without the target's agreement.

Rules (``alpha`` >= 0; ``TV(p, q) = sum_v max(0, p(v) - q(v))``), with ``pi = (1 - d) q + d p``:

- ``chow``: d = 1 if max q < 1 - alpha
- ``diff``: d = 1 if max q < max p - alpha
- ``opt``: d = 1 if max q < max p - alpha * TV(p, q)

and per token, ``pi(v) = q(v) (1 - r(v)) + p(v) * sum_u r(u) q(u)`` with

- ``token_v1``: r(v) = 1 if q(v) < max p - alpha
- ``token_v2``: r(v) = 1 if p(v) < max p - alpha
- ``token_v3``: r(v) = 1 if p(v) < (1 - alpha) max p

``q`` and ``p`` are the warped distributions (temperature, top-k, top-p) at a position. Verification
is speculative sampling against ``pi`` instead of ``p``: accept ``y_k`` with
``min(1, pi(y_k) / q(y_k))``, on rejection sample from ``norm(max(0, pi - q))``, and when every
candidate is accepted draw the bonus token from ``pi`` at the next position, for which the draft
spends one more forward (the paper's Alg. 4). Every emitted token then follows ``pi`` at its
position exactly (tests/decoders/test_cascade.py).

Greedy decoding (temperature 0) follows the paper's greedy limit (its Lemma 8): the deferral
decisions read the softmax distributions of the raw logits (confidence ``max q``, ``max p``), and
``TV`` the one-hot (greedy) distributions; the emitted token is then the argmax of ``pi`` built from
the one-hot distributions: the draft's argmax where the rule keeps the draft, the target's where it
defers (for the token rules: the draft's argmax ``y`` unless ``r(y) = 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.sampling import SamplingConfig, dense_rows, draw_token, warp
from ..core.verify import verify
from .rounds import Candidates

RULES = ("chow", "diff", "opt", "token_v1", "token_v2", "token_v3")


@dataclass(frozen=True)
class Cascade:
    """A deferral rule and its ``alpha``; ``SpeculativeDecoder(..., cascade=Cascade("opt", 0.1))``."""

    rule: str
    alpha: float

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"Cascade: rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or math.isnan(a) or a < 0:
            raise ValueError(f"Cascade: alpha must be a number >= 0, got {a!r}")

    @property
    def name(self) -> str:
        return f"{self.rule}_a{self.alpha:g}"

    def target(self, q: torch.Tensor, p: torch.Tensor, q_conf: torch.Tensor | None = None,
               p_conf: torch.Tensor | None = None) -> torch.Tensor:
        """``pi`` for rows of ``q``, ``p`` [..., V]. ``q_conf``/``p_conf`` are the distributions
        the rule's confidences read (default ``q``, ``p``; the softmax ones under greedy)."""
        q_conf = q if q_conf is None else q_conf
        p_conf = p if p_conf is None else p_conf
        alpha = float(self.alpha)
        max_q, max_p = q_conf.max(-1, keepdim=True).values, p_conf.max(-1, keepdim=True).values
        if self.rule in ("chow", "diff", "opt"):
            if self.rule == "chow":
                defer = max_q < 1.0 - alpha
            elif self.rule == "diff":
                defer = max_q < max_p - alpha
            else:
                tv = (p - q).clamp_min(0).sum(-1, keepdim=True)
                defer = max_q < max_p - alpha * tv
            return torch.where(defer, p, q)
        if self.rule == "token_v1":
            r = q_conf < max_p - alpha
        elif self.rule == "token_v2":
            r = p_conf < max_p - alpha
        else:
            r = p_conf < (1.0 - alpha) * max_p
        r = r.to(q.dtype)
        return q * (1 - r) + p * (r * q).sum(-1, keepdim=True)


class CascadeRule:
    """The acceptance rule of a cascade, with :class:`~specdecpp.decoders.rounds.ExactRule`'s call. It reads
    what the exact rule does not of the :class:`~specdecpp.decoders.rounds.Candidates`: the draft's raw
    logits of the candidates (greedy confidences) and, when every candidate is accepted, the draft's
    logits at the next position (``peek()``, one more draft forward) for the bonus token's ``pi``."""

    lossy = True

    def __init__(self, cascade: Cascade, sampling: SamplingConfig) -> None:
        if not isinstance(cascade, Cascade):
            raise TypeError(f"cascade must be a specdecpp.Cascade or None, got {type(cascade).__name__}")
        self.cascade, self.sampling = cascade, sampling
        self.name = f"cascade_{cascade.name}"

    def _pi(self, draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
        """pi rows from raw logits rows [n, V] of both models."""
        cfg = self.sampling
        if cfg.greedy:  # one-hot distributions; confidences from the softmax (Lemma 8)
            q, p = warp(draft_logits, cfg), warp(target_logits, cfg)
            return self.cascade.target(q, p, torch.softmax(draft_logits.float(), -1),
                                       torch.softmax(target_logits.float(), -1))
        return self.cascade.target(warp(draft_logits, cfg), warp(target_logits, cfg))

    def __call__(self, drafted: Candidates, logits: torch.Tensor, gen: torch.Generator | None,
                 bonus: bool = True) -> tuple[int, int | None]:
        tokens, draft_logits, peek = drafted.tokens, drafted.logits, drafted.peek
        k = tokens.shape[0]
        if not bonus:
            raise ValueError("a cascade verifies with a bonus token (PEARL's bonus-free rounds are not supported)")
        if k and (draft_logits is None or draft_logits.shape[0] != k):
            raise ValueError(f"CascadeRule: expected the draft's logits of the {k} candidates")
        if self.sampling.greedy:
            if k:
                pi = self._pi(draft_logits, logits[:k])
                agree = (pi.argmax(-1) == tokens).tolist()
                n = agree.index(False) if False in agree else k
                if n < k:
                    return n, int(pi[n].argmax(-1))
            return k, int(self._pi(peek().unsqueeze(0), logits[k : k + 1])[0].argmax(-1))
        if k:
            q = torch.stack(dense_rows(drafted.q))
            pi = self.cascade.target(q, warp(logits[:k], self.sampling))
            n, token = verify(tokens, q, pi, gen, bonus=False)
            if token is not None:
                return n, token
        pi_next = self._pi(peek().unsqueeze(0), logits[k : k + 1])[0]
        return k, draw_token(pi_next, gen)
