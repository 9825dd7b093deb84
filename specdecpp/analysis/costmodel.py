"""The paper's cost model (SpecDec++ Section 2) and the one ``costs.json`` it is read from.

- Eq. 2.1: T_total = t_draft * N_draft + t_target * N_target. :func:`fit_cost_model` recovers
  (t_draft, t_target) by least squares over many generations, with R^2 (Table 2).
- Eq. 2.3: latency per token = t_draft + t_draft * N_discarded/N + (t_target - t_draft) * N_target/N
  (:func:`predicted_latency_per_token`; over target-only's t_target it is
  :func:`speedup_over_target_only`).
- The width curve t_target(n): the target's cost of scoring n tokens at once after a cached prefix
  (a verification of K candidates scores K + 1), :meth:`Costs.target_cost`; with it a generation
  costs t_draft * N_draft + sum over rounds of t_target(K_r + 1) (:func:`latency_by_width`).

``costs.json`` (written by ``python -m infer.costs``, read by :func:`load_costs`)::

    {"schema": "specdecpp.costs/1",
     "t_draft": 0.0021, "t_target": 0.0157,            # seconds per cached one-token forward
     "target_by_width": {"1": 0.0157, "2": 0.0171, ...},  # optional: t_target(n), n tokens at once
     "target_by_batch": {"4": {"1": 0.021, "2": 0.024, ...}, ...},  # optional: t_target(B, n), B rows of n
     "draft_by_batch": {"4": 0.0031, ...},                # optional: t_draft(B), B rows of one token
     "draft_by_width": {"1": 0.0021, "2": 0.0023, ...},   # optional: the draft's, n tokens at once
     "draft": "...", "target": "...", "device": "cpu", "dtype": "bfloat16", "threads": 1,
     "measured_by": "python -m infer.costs"}             # provenance, kept as ``Costs.meta``

Files without ``schema`` (what ``scripts/measure_pair.py --costs-out`` wrote) have the same keys
and load the same way; an ``infer.report`` ``summary.json`` gives its first fitted group's costs.
All functions are elementwise in numpy arrays, so bootstrap statistics call them directly.

Batches (``SpeculativeDecoder.generate_batch``): a round of B rows costs one draft forward of B
rows per draft step (the longest row's K steps) and one target forward of B rows of width
max_b K_b + 1, so Eq. 2.1 becomes T = sum over rounds of K_max,r * t_draft(B_r) + t_target(B_r,
K_max,r + 1) (:func:`batch_latency`, from the rounds a batch call records); at B = 1 it is
:func:`latency_by_width` times N.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..core.jsonfile import read_json

SCHEMA = "specdecpp.costs/1"


# -- Eq. 2.1: fitting per-forward costs from timed generations ---------------------------------

@dataclass(frozen=True)
class CostFit:
    """Per-forward-pass costs fitted from (N_draft, N_target, T_total) tuples."""

    t_draft: float
    t_target: float
    r2: float
    n_rows: int

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def problem(self) -> str | None:
        """Why these costs cannot price Eq. 2.3, or None: a fitted cost that is not positive (or not
        finite) is no cost of a forward but the least-squares answer to counts that do not tell the
        two costs apart, e.g. fixed-K rows alone, whose N_draft and N_target rise together. The
        report flags it and predicts nothing from it; ``load_costs`` skips it."""
        bad = [f"{name} = {value * 1e3:.3f} ms"
               for name, value in (("t_draft", self.t_draft), ("t_target", self.t_target))
               if not (math.isfinite(value) and value > 0)]
        if not bad:
            return None
        return (f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not positive, which no forward costs: the "
                f"{self.n_rows} timed rows do not pin the two costs down (their N_draft and N_target rise together, as "
                "fixed-K rows alone do, or their walls are too noisy); add target-only rows (method=target_only) to "
                "the table, or measure the costs with "
                "`python -m infer.costs --costs-out FILE` and pass --costs FILE")


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


# -- Eq. 2.3 -------------------------------------------------------------------------------------

def predicted_latency_per_token(t_draft, t_target, discard_rate, verification_rate):
    """Eq. 2.3: seconds per generated token from the two hardware-independent rates."""
    return t_draft + t_draft * discard_rate + (t_target - t_draft) * verification_rate


def predicted_tokens_per_s(t_draft: float, t_target: float, discard_rate: float,
                           verification_rate: float) -> float:
    latency = predicted_latency_per_token(t_draft, t_target, discard_rate, verification_rate)
    return 1.0 / latency if latency > 0 else math.nan


def speedup_over_target_only(ratio, discard_rate, verification_rate):
    """Eq. 2.3 relative to target-only (t_target per token) at cost ratio c = t_draft / t_target:
    1 / (c + c * discard_rate + (1 - c) * verification_rate)."""
    return 1.0 / predicted_latency_per_token(ratio, 1.0, discard_rate, verification_rate)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Closed form for i.i.d. acceptance alpha and fixed K: (1 - alpha^(K+1)) / (1 - alpha)."""
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def fixed_k_speedup(alpha: float, ratio: float, k: int) -> float:
    """Eq. 2.3 for fixed K under i.i.d. acceptance alpha: per round, tokens (1 - alpha^(K+1)) /
    (1 - alpha) at verification rate 1 / tokens and K - (tokens - 1) discards, which reduces to
    tokens / (K c + 1) target passes."""
    tokens = expected_tokens_per_round(alpha, k)
    return float(speedup_over_target_only(ratio, (k - (tokens - 1)) / tokens, 1.0 / tokens))


# -- the costs of one pair, with the width curve -----------------------------------------------

@dataclass(frozen=True)
class Costs:
    """t_draft and t_target per forward (seconds, or any unit: only ratios matter), optionally the
    target's cost of scoring n tokens at once, ``target_by_width[n]`` (n = 1 is one token), and
    where they were measured (``meta``: draft, target, device, dtype, threads, measured_by)."""

    t_draft: float
    t_target: float
    target_by_width: Mapping[int, float] | None = None
    meta: Mapping = field(default_factory=dict, compare=False)
    _: KW_ONLY  # the other curves by name only: a positional slip would swap one curve for another
    target_by_batch: Mapping[int, Mapping[int, float]] | None = None
    draft_by_batch: Mapping[int, float] | None = None
    draft_by_width: Mapping[int, float] | None = None

    @property
    def ratio(self) -> float:
        return self.t_draft / self.t_target

    @classmethod
    def from_ratio(cls, ratio: float) -> Costs:
        if not (0.0 <= ratio < 1.0):
            raise ValueError(f"cost ratio t_draft / t_target must be in [0, 1), got {ratio!r}")
        return cls(t_draft=ratio, t_target=1.0)

    def target_cost(self, width):
        """t_target(width), interpolated linearly between measured widths, held flat beyond."""
        return _interpolate(self.target_by_width, width, "target_by_width")

    def draft_cost(self, width):
        """t_draft(width): the draft's cost of one forward over ``width`` tokens after a cached prefix
        (a token tree's level), interpolated like :meth:`target_cost`."""
        return _interpolate(self.draft_by_width, width, "draft_by_width")

    def verification_cost(self, widths: Mapping[int, int]) -> float:
        """Seconds of the target's verifications: ``widths[K]`` rounds of K candidates, each
        scoring K + 1 tokens at t_target(K + 1)."""
        return float(sum(r * self.target_cost(k + 1) for k, r in widths.items()))

    def batch_target_cost(self, rows: int, width: int) -> float:
        """t_target(B, n): B rows of n tokens each in one forward, interpolated linearly in n at the
        nearest measured batch sizes and then in B (held flat beyond the measured ones)."""
        curves = {int(b): c for b, c in (self.target_by_batch or {}).items()}
        if not curves:
            raise ValueError("no batched target cost given (costs.json has no target_by_batch): "
                             "measure it with `python -m infer.costs --batch-sizes 1 4 16`")
        sizes = sorted(curves)
        by_size = [float(np.interp(width, sorted(map(int, curves[b])),
                                   [curves[b][n] for n in sorted(curves[b], key=int)])) for b in sizes]
        return float(np.interp(rows, sizes, by_size))

    def batch_draft_cost(self, rows: int) -> float:
        """t_draft(B): B rows of one token in one draft forward (interpolated in B)."""
        if not self.draft_by_batch:
            raise ValueError("no batched draft cost given (costs.json has no draft_by_batch): "
                             "measure it with `python -m infer.costs --batch-sizes 1 4 16`")
        sizes = sorted(int(b) for b in self.draft_by_batch)
        return float(np.interp(rows, sizes, [self.draft_by_batch[b] for b in sizes]))

    def to_dict(self) -> dict:
        """The ``costs.json`` payload (schema :data:`SCHEMA`)."""
        out = {"schema": SCHEMA, "t_draft": self.t_draft, "t_target": self.t_target}
        if self.target_by_width:
            out["target_by_width"] = {str(int(n)): float(t) for n, t in sorted(self.target_by_width.items())}
        if self.target_by_batch:
            out["target_by_batch"] = {str(int(b)): {str(int(n)): float(t) for n, t in sorted(c.items())}
                                      for b, c in sorted(self.target_by_batch.items())}
        if self.draft_by_batch:
            out["draft_by_batch"] = {str(int(b)): float(t) for b, t in sorted(self.draft_by_batch.items())}
        if self.draft_by_width:
            out["draft_by_width"] = {str(int(n)): float(t) for n, t in sorted(self.draft_by_width.items())}
        return {**out, **{k: v for k, v in self.meta.items() if k not in out}}


def _interpolate(by_width: Mapping[int, float] | None, width, key: str):
    """A width curve at ``width``, linear between measured widths, flat beyond."""
    curve = sorted((int(n), float(t)) for n, t in (by_width or {}).items())
    if not curve:
        raise ValueError(f"no width-dependent cost given (costs.json has no {key}; measure it with "
                         "`python -m infer.costs --costs-out FILE`)")
    out = np.interp(width, [x for x, _ in curve], [y for _, y in curve])
    return float(out) if np.ndim(out) == 0 else out


def latency_by_width(costs: Costs, n_tokens, n_draft, verification_cost):
    """Seconds per token with a width-dependent target: (t_draft * N_draft + the verifications'
    cost, :meth:`Costs.verification_cost`) / N."""
    return (costs.t_draft * n_draft + verification_cost) / n_tokens


def batch_latency(costs: Costs, rounds: Sequence[Sequence[int]]) -> float:
    """Eq. 2.1 for a batch call: seconds of its ``rounds``, each ``(B_r, K_max_r[, D_r])`` (rows in
    the round, the longest row's candidates, the draft forwards: K_max_r unless given, K_max_r + 1
    where a cascade's bonus token needed the draft's q): D_r draft forwards of B_r rows and one target
    forward of B_r rows of K_max_r + 1 tokens. Divide the call's generated tokens by it for tokens/s."""
    total = 0.0
    for r in rounds:
        b, k = int(r[0]), int(r[1])
        d = int(r[2]) if len(r) > 2 else k
        total += d * costs.batch_draft_cost(b) + costs.batch_target_cost(b, k + 1)
    return float(total)


# -- costs.json ------------------------------------------------------------------------------------

def save_costs(costs: Costs, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs.to_dict(), indent=1) + "\n")
    return path


def load_costs(path: str | Path) -> Costs:
    """Read a ``costs.json`` (see the module docstring; also the older files without ``schema``
    and an ``infer.report`` summary.json). Every problem names the file and what is wrong."""
    path = Path(path)
    hint = "measure it with `python -m infer.costs --costs-out FILE`"
    data = read_json(path, "costs file", hint)
    if isinstance(data, list) and data and all(isinstance(g, dict) and "fit" in g for g in data):
        data = {"groups": data}  # infer.report's summary.json is a list of groups
    if isinstance(data, dict) and "t_draft" not in data and "groups" in data:
        fitted = [g for g in data["groups"] if g.get("fit")]
        fits = [g["fit"] for g in fitted if not g.get("fit_problem")]  # a flagged fit (CostFit.problem) prices nothing
        if not fits:
            flagged = f"; its fits are flagged: {fitted[0]['fit_problem']}" if fitted else ""
            raise ValueError(f"costs file {str(path)!r}: the report has no fitted cost model "
                             f"with positive costs{flagged}")
        data = {**fits[0], "measured_by": f"Eq. 2.1 fit in {path}"}
    if not isinstance(data, dict):
        raise ValueError(f"costs file {str(path)!r}: expected a JSON object with t_draft and t_target")
    schema = data.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise ValueError(f"costs file {str(path)!r}: unknown schema {schema!r} (this version reads {SCHEMA!r})")
    if "t_draft" not in data or "t_target" not in data:
        raise ValueError(f"costs file {str(path)!r}: needs keys t_draft and t_target (seconds per forward); {hint}")
    try:
        t_draft, t_target = float(data["t_draft"]), float(data["t_target"])
        width = {int(n): float(t) for n, t in (data.get("target_by_width") or {}).items()}
        by_batch = {int(b): {int(n): float(t) for n, t in c.items()}
                    for b, c in (data.get("target_by_batch") or {}).items()}
        draft_batch = {int(b): float(t) for b, t in (data.get("draft_by_batch") or {}).items()}
        draft_width = {int(n): float(t) for n, t in (data.get("draft_by_width") or {}).items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"costs file {str(path)!r}: t_draft, t_target and the width curves must be numbers "
                         f"({exc})") from exc
    if not (0 < t_draft < t_target):
        raise ValueError(f"costs file {str(path)!r}: need 0 < t_draft < t_target, got {t_draft} and {t_target}")
    for key, curve in (("target_by_width", width), ("draft_by_width", draft_width)):
        if any(n < 1 or t <= 0 for n, t in curve.items()):
            raise ValueError(f"costs file {str(path)!r}: {key} needs widths >= 1 and positive seconds, got {curve}")
    if any(b < 1 or n < 1 or t <= 0 for b, c in by_batch.items() for n, t in c.items()) or \
            any(b < 1 or t <= 0 for b, t in draft_batch.items()):
        raise ValueError(f"costs file {str(path)!r}: target_by_batch / draft_by_batch need batch sizes and "
                         f"widths >= 1 and positive seconds")
    meta = {k: v for k, v in data.items() if k not in ("schema", "t_draft", "t_target", "target_by_width",
                                                       "target_by_batch", "draft_by_batch", "draft_by_width",
                                                       "r2", "n_rows")}
    return Costs(t_draft, t_target, width or None, meta, target_by_batch=by_batch or None,
                 draft_by_batch=draft_batch or None, draft_by_width=draft_width or None)
