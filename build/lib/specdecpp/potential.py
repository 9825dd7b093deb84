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
that started at s; ``ctx`` holds the row's arrays. Built in:

- :func:`fixed_k`: K candidates;
- :func:`informed`: Algorithm 2 with a perfect head: stop when 1 - prod_{i<k} P_{s+i-1} > h, the
  same one-candidate lag as the real head (candidate k is drafted before its own acceptance
  estimate exists), at least ``min_candidates`` candidates;
- :func:`informed_lag_free`: the same perfect head without the lag (stop when 1 - prod_{i<=k} P > h),
  the ceiling of a lag-free head;
- :func:`head_rule`: the same rule with a trained head's predictions P_hat_i instead of P_i;
- :func:`svip`: stop when sqrt(c * H(q_i)) > h at the candidate just drafted (no lag);
- :func:`oracle`: hindsight: drafts exactly the candidates that will be accepted (no discards).

Costs: Eq. 2.3 with a cost ratio c = t_draft / t_target gives the speedup over target-only,
``1 / (c + c * discard_rate + (1 - c) * verification_rate)``; with a measured width-dependent
target cost t_target(n) (a verification of K candidates scores K + 1 tokens) the latency is
``(t_draft * N_draft + sum_rounds t_target(K_r + 1)) / N`` against target-only's ``t_target(1)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

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
    if k < 1:
        raise ValueError(f"fixed_k: k must be >= 1, got {k}")
    return Policy("fixed_k", {"k": k}, lambda s, j, ctx: j >= k, k)


def _threshold(name: str, h: float) -> float:
    if not (0.0 <= float(h) <= 1.0) or math.isnan(h):
        raise ValueError(f"{name}: threshold must be in [0, 1], got {h!r}")
    return float(h)


def _algorithm2(column: str, h: float, min_candidates: int, lag: int = 1) -> StopRule:
    def rule(s: int, k: int, ctx: dict) -> bool:
        if k - lag < 1 or k < min_candidates:  # the product over i <= k - lag is empty
            return False
        return 1.0 - float(np.prod(ctx[column][s : s + k - lag])) > h
    return rule


def informed(threshold: float, min_candidates: int = 1, max_candidates: int = 20) -> Policy:
    """Algorithm 2 with a perfect head: it knows every P_i (with the real head's lag)."""
    h = _threshold("informed", threshold)
    return Policy("informed", {"threshold": h}, _algorithm2("p_acc", h, min_candidates), max_candidates)


def informed_lag_free(threshold: float, min_candidates: int = 1, max_candidates: int = 20) -> Policy:
    """A perfect head without the lag: after drafting y_k it already knows P_k (what a head that
    scores y_k from the state right after sampling it could learn), so it may stop at K = 1."""
    h = _threshold("informed_lag_free", threshold)
    return Policy("informed_lag_free", {"threshold": h}, _algorithm2("p_acc", h, min_candidates, lag=0), max_candidates)


def head_rule(name: str, threshold: float, min_candidates: int = 1, max_candidates: int = 20,
              lag: int = 1) -> Policy:
    """Algorithm 2 with a trained head's predictions (``ctx['pred:' + name]``); ``lag`` is the
    head's (1: the paper's head, 0: the lag-free head)."""
    h = _threshold("head", threshold)
    return Policy(f"head:{name}", {"threshold": h}, _algorithm2("pred:" + name, h, min_candidates, lag=lag),
                  max_candidates)


def svip(threshold: float, c: float = 0.15, max_candidates: int = 40) -> Policy:
    """SVIP: stop after the candidate whose draft distribution has sqrt(c * H) > threshold."""
    h = _threshold("svip", threshold)
    return Policy("svip", {"threshold": h},
                  lambda s, k, ctx: math.sqrt(c * float(ctx["draft_entropy"][s + k - 1])) > h, max_candidates)


def oracle(max_candidates: int = 10_000) -> Policy:
    """Hindsight: stop before the first candidate that will be rejected (never discards)."""
    return Policy("oracle", {}, lambda s, k, ctx: False, max_candidates)


def simulate_row(p_acc: np.ndarray, uniforms: np.ndarray, policy: Policy, ctx: dict | None = None) -> Counts:
    """Replay rounds along one response of N = len(p_acc) tokens."""
    n = len(p_acc)
    accepted = uniforms < p_acc
    ctx = ctx if ctx is not None else {"p_acc": p_acc}
    counts = Counts(tokens=n)
    s = 0
    while s < n:
        k_max = min(policy.max_candidates, n - s - 1)
        if policy.name == "oracle":
            k = 0
            while k < k_max and accepted[s + k]:
                k += 1
        else:
            k = 0
            while k < k_max:
                k += 1
                if policy.rule(s, k, ctx):
                    break
        n_acc = 0
        while n_acc < k and accepted[s + n_acc]:
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


# -- costs -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Costs:
    """t_draft and t_target per forward (seconds, or any unit: only ratios matter), and optionally
    the target's cost of scoring n tokens at once, ``target_by_width[n]`` (n = 1 is one token)."""

    t_draft: float
    t_target: float
    target_by_width: Mapping[int, float] | None = None

    @property
    def ratio(self) -> float:
        return self.t_draft / self.t_target

    @classmethod
    def from_ratio(cls, ratio: float) -> Costs:
        if not (0.0 <= ratio < 1.0):
            raise ValueError(f"cost ratio t_draft / t_target must be in [0, 1), got {ratio!r}")
        return cls(t_draft=ratio, t_target=1.0)

    def target_cost(self, width: int) -> float:
        """t_target(width), interpolated linearly between measured widths, held flat beyond."""
        curve = sorted((int(n), float(t)) for n, t in (self.target_by_width or {}).items())
        if not curve:
            raise ValueError("no width-dependent target cost given")
        xs, ys = [x for x, _ in curve], [y for _, y in curve]
        return float(np.interp(width, xs, ys))


def speedup_eq23(counts: Counts, ratio: float) -> float:
    """Eq. 2.3 relative to target-only: 1 / (c + c * discard + (1 - c) * verification)."""
    return 1.0 / (ratio + ratio * counts.discard_rate + (1.0 - ratio) * counts.verification_rate)


def speedup_by_width(counts: Counts, costs: Costs) -> float:
    """Latency with a verification of K candidates costing t_target(K + 1), against t_target(1)."""
    total = costs.t_draft * counts.drafted + sum(r * costs.target_cost(k + 1) for k, r in counts.widths.items())
    return costs.target_cost(1) * counts.tokens / total


def _sum(counts: Sequence[Counts], idx: np.ndarray | None = None) -> Counts:
    total = Counts()
    for i in (range(len(counts)) if idx is None else idx):
        total.add(counts[i])
    return total


def bootstrap_interval(per_row: Sequence[Counts], metric: Callable[[Counts], float], n_boot: int = 1000,
                       seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``metric`` over prompts resampled with replacement."""
    rng = np.random.default_rng(seed)
    n = len(per_row)
    tokens = np.array([c.tokens for c in per_row], dtype=float)
    if n == 0 or tokens.sum() == 0:
        return (math.nan, math.nan)
    values = [metric(_sum(per_row, rng.integers(0, n, n))) for _ in range(n_boot)]
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def paired_margin_interval(a: Sequence[Counts], b: Sequence[Counts], metric: Callable[[Counts], float],
                           n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of metric(a) / metric(b) - 1 over the same resampled prompts."""
    rng = np.random.default_rng(seed)
    n = len(a)
    values = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        values.append(metric(_sum(a, idx)) / metric(_sum(b, idx)) - 1.0)
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def summarise(results: Mapping[str, list[Counts]], policies: Sequence[Policy], costs: Costs,
              n_boot: int = 1000) -> list[dict]:
    """One record per policy setting: name, settings, verification_rate, discard_rate, speedup
    (Eq. 2.3 at the cost ratio) with its 95% bootstrap interval over prompts, tokens per round,
    and speedup_by_width when a width-dependent target cost is known."""
    records = []
    ratio = costs.ratio
    for policy in policies:
        per_row = results[policy.label]
        total = _sum(per_row)
        rec = {"name": policy.name, "settings": dict(policy.settings), "label": policy.label,
               "verification_rate": total.verification_rate, "discard_rate": total.discard_rate,
               "tokens_per_round": total.tokens_per_round,
               "speedup": speedup_eq23(total, ratio),
               "speedup_ci95": bootstrap_interval(per_row, lambda c: speedup_eq23(c, ratio), n_boot)}
        if costs.target_by_width:
            rec["speedup_by_width"] = speedup_by_width(total, costs)
            rec["speedup_by_width_ci95"] = bootstrap_interval(per_row, lambda c: speedup_by_width(c, costs), n_boot)
        records.append(rec)
    return records


def best(records: Sequence[dict], name: str, key: str = "speedup") -> dict | None:
    candidates = [r for r in records if r["name"] == name and key in r]
    return max(candidates, key=lambda r: r[key]) if candidates else None


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Closed form for i.i.d. acceptance alpha and fixed K: (1 - alpha^(K+1)) / (1 - alpha)."""
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
