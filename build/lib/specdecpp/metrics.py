"""The paper's cost model and the greedy oracle (SpecDec++ Section 2), as pure functions.

- Eq. 2.1: T_total = t_draft * N_draft + t_target * N_target. :func:`fit_cost_model` recovers
  (t_draft, t_target) by least squares over many generations, with R^2 (Table 2).
- Eq. 2.3: latency per token = t_draft + t_draft * N_discarded/N + (t_target - t_draft) * N_target/N.
- Lemma 2.1, the greedy oracle: stop exactly before each disagreement between the draft's greedy
  prediction and the target's greedy continuation, so N_discarded = 0 and every round verifies
  exactly the candidates the target will accept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .engine import RunStats


@dataclass(frozen=True)
class CostFit:
    """Per-forward-pass costs fitted from (N_draft, N_target, T_total) tuples."""

    t_draft: float
    t_target: float
    r2: float
    n_rows: int

    def to_dict(self) -> dict:
        return asdict(self)


def fit_cost_model(n_draft: Sequence[float], n_target: Sequence[float],
                   wall_time_s: Sequence[float]) -> CostFit:
    """Least-squares fit of T = t_draft * N_draft + t_target * N_target (no intercept, Eq. 2.1).

    R^2 is the usual centred coefficient of determination, 1 - SS_res / SS_tot. Needs rows that
    vary in both counts (e.g. target-only rows beside speculative ones); otherwise the two costs
    cannot be told apart and a ValueError says so.
    """
    x = np.column_stack([np.asarray(n_draft, dtype=float), np.asarray(n_target, dtype=float)])
    y = np.asarray(wall_time_s, dtype=float)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"fit_cost_model: {x.shape[0]} count rows but {y.shape[0]} wall times")
    if x.shape[0] < 2 or np.linalg.matrix_rank(x) < 2:
        raise ValueError("fit_cost_model: need at least two rows whose (N_draft, N_target) are not "
                         "proportional, e.g. target-only runs beside speculative ones")
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((residual**2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return CostFit(t_draft=float(coef[0]), t_target=float(coef[1]), r2=r2, n_rows=int(x.shape[0]))


def predicted_latency_per_token(t_draft: float, t_target: float, discard_rate: float,
                                verification_rate: float) -> float:
    """Eq. 2.3: seconds per generated token from the two hardware-independent rates."""
    return t_draft + t_draft * discard_rate + (t_target - t_draft) * verification_rate


def predicted_tokens_per_s(t_draft: float, t_target: float, discard_rate: float,
                           verification_rate: float) -> float:
    latency = predicted_latency_per_token(t_draft, t_target, discard_rate, verification_rate)
    return 1.0 / latency if latency > 0 else math.nan


def greedy_oracle(target_ids: Sequence[int], draft_predictions: Sequence[int]) -> RunStats:
    """Statistics of the hindsight-optimal stop policy under greedy decoding (Lemma 2.1).

    ``target_ids`` = X_1..X_N, the target's greedy continuation of a prompt; ``draft_predictions``
    = Y_1..Y_N with Y_i = argmax q(. | prompt, X_<i), the draft's greedy prediction at each
    position. A round starting at position s drafts the maximal run Y_s..Y_{s+m-1} that equals
    X_s..X_{s+m-1} (capped so the round stays within N tokens), the target accepts all m and emits
    X_{s+m}. Hence N_discarded = 0 and N_target = number of rounds. Times are left at zero.
    """
    n = len(target_ids)
    if len(draft_predictions) != n:
        raise ValueError(f"greedy_oracle: {n} target tokens but {len(draft_predictions)} draft predictions")
    stats = RunStats(n_generated=n)
    s = 0
    while s < n:
        m = 0
        while s + m < n - 1 and draft_predictions[s + m] == target_ids[s + m]:
            m += 1
        stats.n_target_calls += 1
        stats.n_draft_calls += m
        stats.accept_lengths.append(m)
        stats.candidate_lengths.append(m)
        s += m + 1
    return stats
