"""How close an output is to the target's own decoding: what a lossy method (a speculative cascade)
is judged by beside its speed. Exact methods score the same in expectation as the target itself,
so they are the reference point."""

from __future__ import annotations

import math

import torch

from ..core.sampling import SamplingConfig, warp

LOG_FLOOR = math.log(1e-9)  # a token outside the target's warped support (top-k / top-p) scores this


@torch.no_grad()
def target_quality(target, prompt_ids: torch.Tensor, output_ids: list[int], sampling: SamplingConfig,
                   vocab: int | None = None) -> dict:
    """One target forward over prompt + output. Returns

    - ``target_logprob_per_token``: the mean log-probability of the output tokens under the target's
      warped distribution (under greedy decoding, where that is one-hot, under the softmax of its
      raw logits), each floored at ``LOG_FLOOR``;
    - ``n_outside_support``: output tokens the warped target gives probability 0 (top-k / top-p);
    - ``greedy_match``: the fraction of output tokens equal to the target's argmax at their position.
    """
    if not output_ids:
        return {"target_logprob_per_token": None, "n_outside_support": 0, "greedy_match": None}
    ids = torch.cat([prompt_ids.reshape(-1), torch.tensor(output_ids, device=prompt_ids.device)])
    start = prompt_ids.numel() - 1
    logits = target(ids.unsqueeze(0)).logits[0, start : ids.numel() - 1]
    if vocab is not None:
        logits = logits[:, :vocab]
    out = ids[start + 1 :]
    probs = torch.softmax(logits.float(), -1) if sampling.greedy else warp(logits, sampling)
    p = probs.gather(-1, out.unsqueeze(-1)).squeeze(-1)
    logp = p.clamp_min(1e-9).log()
    return {"target_logprob_per_token": float(logp.mean()), "n_outside_support": int((p <= 0).sum()),
            "greedy_match": float((logits.argmax(-1) == out).float().mean())}
