"""Stop potential: can a learned stop predictor pay off on this pair? Answered from labels alone.

A data_gen dataset holds, for every position i of a target-sampled response, the acceptance
probability P_i = min(1, p(Y_i)/q(Y_i)) of a draft token (and the draft's entropy H(q_i)). This
module replays speculative-decoding rounds along each response without running either model:

- a round that starts at position s drafts candidates at s, s+1, ..., asks a stop rule after each
  one, and accepts candidate i when u_i < P_i, with u_i ~ U(0, 1) drawn once per position and
  seed (common random numbers: every policy meets the same accept/reject outcomes);
- the round emits its accepted candidates plus one target token and the next round starts after
  them; the number of candidates is capped so a round never passes the end of the response
  (as the engine caps it at max_new_tokens).

Stop rules are functions ``rule(s, k, ctx) -> bool`` asked after candidate k (1-based) of a round
that started at s; ``ctx`` holds the row's arrays. Built in, each the decision of a stop policy of
:mod:`specdecpp.stopping.policies` (with its setting checks) on the labels:

- :func:`fixed_k`: K candidates;
- :func:`informed`: Algorithm 2 with a perfect head: stop when 1 - prod_{i<k} P_{s+i-1} > h, the
  same one-candidate lag as the real head (candidate k is drafted before its own acceptance
  estimate exists), at least ``min_candidates`` candidates;
- :func:`informed_lag_free`: the same perfect head without the lag (stop when 1 - prod_{i<=k} P > h),
  the ceiling of a lag-free head;
- :func:`head_rule`: the same rule with a trained head's predictions P_hat_i instead of P_i;
- :func:`svip`: stop when sqrt(c * H(q_i)) > h at the candidate just drafted (no lag);
- :func:`oracle`: hindsight: drafts exactly the candidates that will be accepted (no discards);
  :func:`greedy_oracle` gives its rounds on a greedy generation as the engine's ``RunStats``.

Costs: Eq. 2.3 with a cost ratio c = t_draft / t_target gives the speedup over target-only,
``1 / (c + c * discard_rate + (1 - c) * verification_rate)``; with a measured width-dependent
target cost t_target(n) (a verification of K candidates scores K + 1 tokens) the latency is
``(t_draft * N_draft + sum_rounds t_target(K_r + 1)) / N`` against target-only's ``t_target(1)``;
both formulas live in :mod:`specdecpp.analysis.costmodel`, the intervals in :mod:`specdecpp.analysis.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..stopping.policies import SVIP, FixedK, algorithm2_stops, check_candidates, check_threshold
from .costmodel import Costs, latency_by_width, speedup_over_target_only
from .stats import bootstrap_interval

StopRule = Callable[[int, int, dict], bool]


@dataclass
class Counts:
    """What a policy did on some responses: tokens, rounds (= target calls), candidates drafted,
    discarded candidates, and how many rounds verified each number of candidates."""

    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    discarded: int = 0
    widths: dict[int, int] = field(default_factory=dict)  # K -> rounds with K candidates

    def add(self, other: Counts) -> None:
        self.tokens += other.tokens
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.discarded += other.discarded
        for k, v in other.widths.items():
            self.widths[k] = self.widths.get(k, 0) + v

    @property
    def verification_rate(self) -> float:
        return self.rounds / max(self.tokens, 1)

    @property
    def discard_rate(self) -> float:
        return self.discarded / max(self.tokens, 1)

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / max(self.rounds, 1)


@dataclass(frozen=True)
class Policy:
    """A named stop rule with its settings and its cap on candidates per round."""

    name: str
    settings: dict
    rule: StopRule
    max_candidates: int

    @property
    def label(self) -> str:
        return self.name + ("" if not self.settings else " " + ", ".join(f"{k}={v}" for k, v in self.settings.items()))


def fixed_k(k: int) -> Policy:
    """:class:`~specdecpp.stopping.policies.FixedK`: K candidates."""
    policy = FixedK(k)
    return Policy(policy.name, policy.settings(), lambda s, j, ctx: policy.should_stop(j, None, None),
                  policy.max_candidates)


def round_values(values: np.ndarray, s: int, k: int) -> np.ndarray:
    """A column's values for candidates 1..k of the round that starts at position s: ``values[s:s+k]``,
    or for a feature draft's labels by depth ([N, D]) candidate j's entry at depth j (depth D
    for the candidates past it)."""
    if values.ndim == 1:
        return values[s : s + k]
    j = np.arange(k)
    return values[s + j, np.minimum(j, values.shape[1] - 1)]


def _algorithm2(name: str, column: str, threshold: float, min_candidates: int, max_candidates: int,
                lag: int) -> Policy:
    """:class:`~specdecpp.stopping.policies.SpecDecPP`'s Algorithm 2 with the head's estimates read
    from ``ctx[column]``: after candidate k the product covers P_s .. P_{s+k-1-lag}."""
    h = check_threshold(name, "threshold", threshold)
    low, high = check_candidates(name, min_candidates, max_candidates)

    def rule(s: int, k: int, ctx: dict) -> bool:
        if k - lag < 1:  # the product over i <= k - lag is empty: nothing scored yet
            return False
        return algorithm2_stops(float(np.prod(round_values(ctx[column], s, k - lag))), k, h, low)

    return Policy(name, {"threshold": h}, rule, high)


def informed(threshold: float, min_candidates: int = 1, max_candidates: int = 20) -> Policy:
    """Algorithm 2 with a perfect head: it knows every P_i (with the real head's lag)."""
    return _algorithm2("informed", "p_acc", threshold, min_candidates, max_candidates, lag=1)


def informed_lag_free(threshold: float, min_candidates: int = 1, max_candidates: int = 20) -> Policy:
    """A perfect head without the lag: after drafting y_k it already knows P_k (what a head that
    scores y_k from the state right after sampling it could learn), so it may stop at K = 1."""
    return _algorithm2("informed_lag_free", "p_acc", threshold, min_candidates, max_candidates, lag=0)


def head_rule(name: str, threshold: float, min_candidates: int = 1, max_candidates: int = 20,
              lag: int = 1) -> Policy:
    """Algorithm 2 with a trained head's predictions (``ctx['pred:' + name]``); ``lag`` is the
    head's (1: the paper's head, 0: the lag-free head)."""
    return _algorithm2(f"head:{name}", "pred:" + name, threshold, min_candidates, max_candidates, lag=lag)


def svip(threshold: float, c: float = 0.15, max_candidates: int = 40) -> Policy:
    """:class:`~specdecpp.stopping.policies.SVIP`: stop after the candidate whose draft
    distribution has sqrt(c * H) > threshold, H read from ``ctx['draft_entropy']`` (float64), compared
    as the engine compares it (c * H > threshold ** 2, the policy's float64 arithmetic)."""
    policy = SVIP(threshold, c, max_candidates)
    c, h = policy.c, policy.threshold
    return Policy(policy.name, {"threshold": h},
                  lambda s, k, ctx: c * float(round_values(ctx["draft_entropy"], s, k)[-1]) > h * h,
                  policy.max_candidates)


def oracle(max_candidates: int = 10_000) -> Policy:
    """Hindsight: stop before the first candidate that will be rejected (never discards)."""
    return Policy("oracle", {}, lambda s, k, ctx: False, max_candidates)


def greedy_oracle(target_ids: Sequence[int], draft_predictions: Sequence[int]):
    """Statistics (a ``RunStats``) of the hindsight-optimal stop policy under greedy decoding
    (Lemma 2.1): :func:`oracle`'s rounds on hard labels P_i = [Y_i == X_i].

    ``target_ids`` = X_1..X_N, the target's greedy continuation of a prompt; ``draft_predictions``
    = Y_1..Y_N with Y_i = argmax q(. | prompt, X_<i), the draft's greedy prediction at each
    position. A round starting at position s drafts the maximal run Y_s..Y_{s+m-1} that equals
    X_s..X_{s+m-1} (capped so the round stays within N tokens), the target accepts all m and emits
    X_{s+m}. Hence N_discarded = 0 and N_target = number of rounds. Times are left at zero.
    """
    from ..decoders.rounds import RunStats

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


def simulate_row(p_acc: np.ndarray, uniforms: np.ndarray, policy: Policy, ctx: dict | None = None) -> Counts:
    """Replay rounds along one response of N = len(p_acc) tokens. ``p_acc`` [N], or a feature
    draft's labels by depth [N, D]: a round's j-th candidate is accepted by its label at depth j
    (:func:`round_values`), every depth of a position drawn with the same uniform."""
    n = len(p_acc)
    accepted = (uniforms[:, None] < p_acc) if p_acc.ndim == 2 else uniforms < p_acc
    ctx = ctx if ctx is not None else {"p_acc": p_acc}
    counts = Counts(tokens=n)
    s = 0
    while s < n:
        k_max = min(policy.max_candidates, n - s - 1)
        ok = round_values(accepted, s, k_max)
        if policy.name == "oracle":
            k = 0
            while k < k_max and ok[k]:
                k += 1
        else:
            k = 0
            while k < k_max:
                k += 1
                if policy.rule(s, k, ctx):
                    break
        n_acc = 0
        while n_acc < k and ok[n_acc]:
            n_acc += 1
        counts.rounds += 1
        counts.drafted += k
        counts.discarded += k - n_acc
        counts.widths[k] = counts.widths.get(k, 0) + 1
        s += n_acc + 1
    return counts


def row_uniforms(n: int, seed: int, row: int) -> np.ndarray:
    return np.random.default_rng([int(seed), int(row)]).random(n)


def simulate(rows: Sequence[Mapping[str, np.ndarray]], policies: Sequence[Policy],
             seeds: Sequence[int] = (0, 1, 2, 3, 4)) -> dict[str, list[Counts]]:
    """Counts per policy label and row, summed over seeds (every policy sees the same draws)."""
    out: dict[str, list[Counts]] = {p.label: [Counts() for _ in rows] for p in policies}
    for j, row in enumerate(rows):
        p_acc = np.asarray(row["p_acc"], dtype=np.float64)
        ctx = {k: np.asarray(v, dtype=np.float64) for k, v in row.items()}
        for seed in seeds:
            u = row_uniforms(len(p_acc), seed, j)
            for policy in policies:
                out[policy.label][j].add(simulate_row(p_acc, u, policy, ctx))
    return out


# -- costs and intervals (Eq. 2.3 and t_target(n) from specdecpp.analysis.costmodel) --------------------

def speedup_eq23(counts: Counts, ratio: float) -> float:
    """Eq. 2.3 relative to target-only: 1 / (c + c * discard + (1 - c) * verification)."""
    return float(speedup_over_target_only(ratio, counts.discard_rate, counts.verification_rate))


def speedup_by_width(counts: Counts, costs: Costs) -> float:
    """Latency with a verification of K candidates costing t_target(K + 1), against t_target(1)."""
    latency = latency_by_width(costs, counts.tokens, counts.drafted, costs.verification_cost(counts.widths))
    return costs.target_cost(1) / latency


def _sum(counts: Sequence[Counts], idx: np.ndarray | None = None) -> Counts:
    total = Counts()
    for i in (range(len(counts)) if idx is None else idx):
        total.add(counts[i])
    return total


def _columns(per_row: Sequence[Counts], costs: Costs, by_width: bool) -> list[np.ndarray]:
    """Per prompt: tokens, rounds, discarded, drafted, and the verifications' cost at t_target(n)."""
    cols = [[c.tokens, c.rounds, c.discarded, c.drafted,
             costs.verification_cost(c.widths) if by_width else 0.0] for c in per_row]
    return list(np.asarray(cols, dtype=np.float64).reshape(-1, 5).T)


def _pooled_speedup(costs: Costs, by_width: bool, tokens, rounds, discarded, drafted, verify, axis=-1):
    """Eq. 2.3 (or the width form) of the counts pooled along ``axis`` (vectorized over resamples)."""
    n = np.sum(tokens, axis=axis)
    if by_width:
        return costs.target_cost(1) / latency_by_width(costs, n, np.sum(drafted, axis=axis), np.sum(verify, axis=axis))
    return speedup_over_target_only(costs.ratio, np.sum(discarded, axis=axis) / n, np.sum(rounds, axis=axis) / n)


def speedup_interval(per_row: Sequence[Counts], costs: Costs, by_width: bool = False, n_boot: int = 1000,
                     seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the pooled speedup over prompts resampled with replacement
    (``specdecpp.analysis.stats``); (nan, nan) with fewer than two prompts."""
    if sum(c.tokens for c in per_row) == 0:
        return (math.nan, math.nan)
    def stat(*cols, axis=-1):
        return _pooled_speedup(costs, by_width, *cols, axis=axis)
    return bootstrap_interval(stat, *_columns(per_row, costs, by_width), n_resamples=n_boot, seed=seed, level=level)


def margin_interval(a: Sequence[Counts], b: Sequence[Counts], costs: Costs, by_width: bool = False,
                    n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of speedup(a) / speedup(b) - 1 over the same resampled prompts (paired)."""
    if len(a) != len(b):
        raise ValueError(f"margin_interval: {len(a)} prompts against {len(b)}; a paired margin needs the same prompts")
    def stat(*cols, axis=-1):
        return _pooled_speedup(costs, by_width, *cols[:5], axis=axis) / _pooled_speedup(costs, by_width, *cols[5:],
                                                                                         axis=axis) - 1.0
    return bootstrap_interval(stat, *_columns(a, costs, by_width), *_columns(b, costs, by_width), paired=True,
                              n_resamples=n_boot, seed=seed, level=level)


def summarise(results: Mapping[str, list[Counts]], policies: Sequence[Policy], costs: Costs,
              n_boot: int = 1000) -> list[dict]:
    """One record per policy setting: name, settings, verification_rate, discard_rate, speedup
    (Eq. 2.3 at the cost ratio) with its 95% bootstrap interval over prompts, tokens per round,
    speedup_by_width when a width-dependent target cost is known, and the pooled ``counts`` every
    figure is computed from (tokens, rounds, drafted, discarded, widths: rounds per candidate count)."""
    records = []
    ratio = costs.ratio
    for policy in policies:
        per_row = results[policy.label]
        total = _sum(per_row)
        rec = {"name": policy.name, "settings": dict(policy.settings), "label": policy.label,
               "verification_rate": total.verification_rate, "discard_rate": total.discard_rate,
               "tokens_per_round": total.tokens_per_round,
               "counts": {"tokens": total.tokens, "rounds": total.rounds, "drafted": total.drafted,
                          "discarded": total.discarded, "widths": {str(k): v for k, v in sorted(total.widths.items())}},
               "speedup": speedup_eq23(total, ratio),
               "speedup_ci95": speedup_interval(per_row, costs, n_boot=n_boot)}
        if costs.target_by_width:
            rec["speedup_by_width"] = speedup_by_width(total, costs)
            rec["speedup_by_width_ci95"] = speedup_interval(per_row, costs, by_width=True, n_boot=n_boot)
        records.append(rec)
    return records


def best(records: Sequence[dict], name: str, key: str = "speedup") -> dict | None:
    candidates = [r for r in records if r["name"] == name and key in r]
    return max(candidates, key=lambda r: r[key]) if candidates else None


# -- what if the draft accepted more? ------------------------------------------------------------

WHATIF_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def raise_labels(rows: Sequence[Mapping[str, np.ndarray]], gamma: float) -> list[dict]:
    """The rows with every acceptance probability raised to ``gamma`` (1 leaves them unchanged;
    gamma < 1 raises them, keeping their order and spread across positions)."""
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    return [{**r, "p_acc": np.power(r["p_acc"], gamma)} for r in rows]


def whatif_grid(rows: Sequence[Mapping[str, np.ndarray]], gammas: Sequence[float], ratios: Sequence[float],
                seeds: int = 5, max_k: int = 10) -> list[dict]:
    """One record per (gamma, cost ratio): the mean acceptance of the raised labels and the best
    Eq. 2.3 speedup (and setting) of fixed K 1..max_k, the informed Algorithm 2 (with the head's lag),
    the same perfect head without the lag and the oracle; each family's ``margin`` over fixed K."""
    bad = [c for c in ratios if not 0 <= c < 1]
    if bad:
        raise ValueError(f"cost ratios must be in [0, 1), got {bad}")
    families = {"fixed_k": [fixed_k(k) for k in range(1, max_k + 1)],
                "informed": [informed(h) for h in WHATIF_THRESHOLDS],
                "informed_lag_free": [informed_lag_free(h) for h in WHATIF_THRESHOLDS],
                "oracle": [oracle()]}
    policies = [p for group in families.values() for p in group]
    records = []
    for gamma in gammas:
        rows_g = raise_labels(rows, gamma)
        counts = simulate(rows_g, policies, seeds=range(seeds))
        totals = {p.label: _sum(counts[p.label]) for p in policies}
        mean_p = float(np.concatenate([r["p_acc"] for r in rows_g]).mean())
        for c in ratios:
            rec = {"gamma": gamma, "mean_acceptance": mean_p, "cost_ratio": c}
            for family, group in families.items():
                speed = {p.label: speedup_eq23(totals[p.label], c) for p in group}
                best_label = max(speed, key=speed.get)
                rec[family] = {"speedup": speed[best_label], "setting": best_label}
            for family in ("informed", "informed_lag_free", "oracle"):
                rec[family]["margin"] = rec[family]["speedup"] / rec["fixed_k"]["speedup"] - 1.0
            records.append(rec)
    return records
