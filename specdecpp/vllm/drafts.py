"""One vLLM draft step's candidates, stopped row by row by a stop policy (no vLLM import here).

vLLM's draft loop drafts one candidate for every request of the batch per pass, up to K passes.
:class:`StoppedDrafts` is told each pass's candidates (``add``), asks the policy which rows stop
after them (``stop_rows``, as the batch decoder of the library does), and at the end gives one
draft list per request, of that request's own length (``lists``), and the draft probabilities
those lists were sampled from (``probs``) for vLLM's rejection sampler.
"""

from __future__ import annotations

import torch

from ..stopping.policies import StopPolicy


class StoppedDrafts:
    """The candidates of one propose call under ``policy``, at most ``max_len`` per request.

    ``lengths[b]`` is 0 while row b drafts, then the number of candidates it keeps."""

    def __init__(self, policy: StopPolicy, max_len: int) -> None:
        self.policy = policy
        self.max_len = max_len
        self.tokens: list[torch.Tensor] = []  # per pass: [B]
        self.probs: list[torch.Tensor] = []  # per pass: [B, V] (probabilistic draft sampling only)
        self.lengths: torch.Tensor | None = None  # [B] int64
        policy.begin_round(None)

    @property
    def done(self) -> bool:
        """Every row has stopped (or nothing is to be drafted)."""
        return self.max_len == 0 or (self.lengths is not None and bool((self.lengths > 0).all()))

    @torch.no_grad()
    def add(self, logits: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor,
            probs: torch.Tensor | None) -> bool:
        """Candidates ``tokens`` [B] of this pass, drafted from the draft's raw ``logits`` [B, V] at the
        states ``hidden`` [B, H] (those that produced the logits), ``probs`` [B, V] the distribution they
        were sampled from (None: greedy). Returns whether every row has now stopped."""
        k = len(self.tokens) + 1
        if self.lengths is None:
            self.lengths = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        self.tokens.append(tokens)
        if probs is not None:
            self.probs.append(probs)
        active = self.lengths == 0
        if k >= self.max_len:
            stop = active
        else:
            policy = self.policy
            stop = policy.stop_rows(k, logits, hidden if policy.needs_hidden else None, tokens, active).to(
                active.device) & active
        self.lengths[stop] = k
        return self.done

    def lists(self, batch_size: int) -> list[list[int]]:
        """One draft list per request, row b's first ``lengths[b]`` candidates."""
        if not self.tokens:
            return [[] for _ in range(batch_size)]
        drafted = torch.stack(self.tokens, dim=1)[:batch_size].tolist()
        lengths = self.lengths.tolist()
        return [row[:n] for row, n in zip(drafted, lengths, strict=True)]

    def stacked_probs(self) -> torch.Tensor | None:
        """[B, passes, V]: the draft distributions, None where the draft sampled greedily."""
        return torch.stack(self.probs, dim=1).contiguous() if self.probs else None
