"""Load-aware draft lengths: each step, every request's length chosen to maximise the step's expected
committed tokens per second, from the stop policy's per-position acceptance estimates and a step-cost
curve measured at start-up (docs/vllm.md, "Load-aware lengths"). Pure torch and Python: no vLLM here.

The model of one step of B requests, request r drafting ``L_r`` candidates:

- ``a[r, k]`` is the estimated probability that r's k-th candidate is accepted given that the earlier
  ones were, so ``P[r, k] = prod_{i <= k} a[r, i]`` is the chance its first k are all accepted and
  ``E_r(L) = 1 + sum_{k <= L} P[r, k]`` its expected committed tokens (the target's own token counts 1);
- the step takes ``target(S) + sum_k draft_pass(k)`` seconds: the target verifies ``S = sum_r (L_r + 1)``
  tokens, and the draft's k-th pass runs over ``n_k`` rows, ``n_k = #{r : L_r >= k}``. In ``"active"``
  mode a pass costs ``draft(n_k)`` (a batch of the rows still drafting, the issue's model); in
  ``"dense"`` mode it costs ``draft(B)`` whenever ``n_k > 0`` (vLLM's draft loop runs over the whole
  batch until every row has stopped: specdecpp.vllm's case).

:func:`choose_lengths` maximises ``sum_r E_r(L_r) / seconds``. The search: for a maximal length M and
a number j of drafted candidates, the cost in dense mode depends on (M, j) alone, and the j candidates
with the largest ``P[r, k]`` (k <= M) give the most committed tokens; since ``P[r, k]`` does not grow
with k, those j form a prefix of every row (ties are taken in position order), i.e. a valid choice of
lengths. Enumerating every (M, j) is therefore **exact in dense mode, and in active mode whenever the
draft curve is affine with an overhead** (``draft(n) = d0 + d1 n`` for n >= 1, ``d0 >= 0``: the cost is
then ``target(B + j) + d0 * passes + d1 * j``, passes <= M); each candidate's true cost is evaluated.
In active mode with another draft curve the enumeration is followed by a local search (set one row
to another length while the rate rises), which is not proven exact: on the test's 150 random cases of 1-5
rows x 1-3 positions it matched brute force on 146, the worst at 0.936 of the best rate (a draft
curve flat up to 2 rows, then steep: the best pairs two rows per pass, which one-row moves miss).
Cost: O(K * R K log(R K)) tensor work for R rows and K positions (256 x 8 in milliseconds on a CPU).

:class:`OnlineLengths` is the form usable inside a draft loop that drafts position by position: after
each pass it re-plans the rest of the step (the passes run so far are paid for, the kept candidates
fixed, later acceptances predicted as the row's latest estimate repeating) and says which rows keep the
candidate just drafted and which draft another. In dense mode, with exact predictions (each row's
acceptance constant over positions), its lengths equal :func:`choose_lengths`'s whenever that drafts at
all (a pass's cost does not depend on which rows it serves, so the paid passes change no later choice);
in active mode the first pass has already served every row, so it may keep more first candidates.

:class:`StepCosts` holds the two measured curves (piecewise-linear, monotone, JSON), and
:func:`measure_step_costs` measures them for any callable forward.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import torch

from ..core.jsonfile import read_json
from ..core.timing import machine_description, time_forward

DRAFT_MODES = ("dense", "active")
COSTS_FORMAT = 1


def _check_curve(name: str, xs, ys, *, min_x: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The points of a measured curve: as many x as y, at least one, x strictly increasing from
    ``min_x``, y finite, >= 0 and not decreasing (a cost that falls with load is a measurement error)."""
    xs = tuple(float(x) for x in xs)
    ys = tuple(float(y) for y in ys)
    if not xs or len(xs) != len(ys):
        raise ValueError(f"StepCosts: {name} needs one or more (size, seconds) points, got {len(xs)} sizes and "
                         f"{len(ys)} times")
    if any(not math.isfinite(v) for v in xs + ys):
        raise ValueError(f"StepCosts: {name} has a non-finite point: sizes {xs}, seconds {ys}")
    if xs[0] < min_x or any(b <= a for a, b in pairwise(xs)):
        raise ValueError(f"StepCosts: {name} sizes must be strictly increasing from {min_x:g}, got {xs}")
    if ys[0] < 0 or any(b < a for a, b in pairwise(ys)):
        raise ValueError(f"StepCosts: {name} seconds must be >= 0 and not decrease with size (monotone), got {ys}; "
                         "measure_step_costs(monotone=True) takes the running maximum of noisy timings")
    return xs, ys


def interpolate(x: torch.Tensor, xs: Sequence[float], ys: Sequence[float]) -> torch.Tensor:
    """The piecewise-linear curve through (xs, ys) at ``x`` (float64): flat before the first point,
    continued with the last segment's slope after the last (flat for a single point)."""
    px = torch.tensor(xs, dtype=torch.float64)
    py = torch.tensor(ys, dtype=torch.float64)
    x = torch.as_tensor(x, dtype=torch.float64)
    if px.numel() == 1:
        return py[0].expand_as(x).clone()
    i = torch.searchsorted(px, x.clamp(min=px[0]).contiguous(), right=True).clamp(1, px.numel() - 1)
    x0, x1, y0, y1 = px[i - 1], px[i], py[i - 1], py[i]
    return y0 + (x.clamp(min=px[0]) - x0) * (y1 - y0) / (x1 - x0)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step's forwards, measured: the target's against the total tokens it scores in a
    step (``target_tokens`` -> ``target_seconds``) and one draft pass's against its batch size
    (``draft_batch`` -> ``draft_seconds``); piecewise-linear between points (:func:`interpolate`), a draft
    pass of 0 rows costs 0. ``meta``: where and how they were measured."""

    target_tokens: tuple[float, ...]
    target_seconds: tuple[float, ...]
    draft_batch: tuple[float, ...]
    draft_seconds: tuple[float, ...]
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        tt, ts = _check_curve("the target curve", self.target_tokens, self.target_seconds, min_x=1)
        db, ds = _check_curve("the draft curve", self.draft_batch, self.draft_seconds, min_x=1)
        for name, value in (("target_tokens", tt), ("target_seconds", ts), ("draft_batch", db),
                            ("draft_seconds", ds)):
            object.__setattr__(self, name, value)

    def target(self, tokens) -> torch.Tensor:
        """Seconds of a target forward over ``tokens`` scheduled tokens (a number or a tensor)."""
        return interpolate(torch.as_tensor(tokens), self.target_tokens, self.target_seconds)

    def draft(self, batch) -> torch.Tensor:
        """Seconds of one draft pass over ``batch`` rows (0 rows: 0 s)."""
        batch = torch.as_tensor(batch, dtype=torch.float64)
        return torch.where(batch > 0, interpolate(batch, self.draft_batch, self.draft_seconds), 0.0)

    @property
    def draft_is_affine(self) -> bool:
        """Is ``draft(n) = d0 + d1 n`` over n >= 1 with an overhead ``d0 >= 0`` (the case in which the
        active-mode search is exact)? The curve is flat before its first point, so it is when it is flat
        throughout or its points, the first at n = 1, lie on one line whose value at n = 0 is >= 0."""
        xs, ys = self.draft_batch, self.draft_seconds
        if ys[0] == ys[-1]:
            return True
        if xs[0] > 1:
            return False
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
        on_line = all(abs((y - ys[0]) - slope * (x - xs[0])) <= 1e-9 * max(abs(y), 1e-12)
                      for x, y in zip(xs, ys, strict=True))
        return on_line and ys[0] - slope * xs[0] >= -1e-9 * ys[0]

    def to_json(self) -> dict:
        return {"format": COSTS_FORMAT, "target_tokens": list(self.target_tokens),
                "target_seconds": list(self.target_seconds), "draft_batch": list(self.draft_batch),
                "draft_seconds": list(self.draft_seconds), "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict, where: str = "step costs") -> StepCosts:
        if not isinstance(data, dict) or data.get("format") != COSTS_FORMAT:
            raise ValueError(f"{where}: not a step-costs file of format {COSTS_FORMAT} (StepCosts.save writes one)")
        keys = ("target_tokens", "target_seconds", "draft_batch", "draft_seconds")
        missing = [k for k in keys if k not in data]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        return cls(*(tuple(data[k]) for k in keys), meta=dict(data.get("meta") or {}))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> StepCosts:
        return cls.from_json(read_json(path, "step-costs file", "StepCosts.save or measure_step_costs writes one"),
                             where=f"step-costs file {str(path)!r}")


def measure_curve(forward: Callable[[int], object], sizes: Sequence[int], *, repeats: int = 5, warmup: int = 1,
                  monotone: bool = True) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Median seconds of ``forward(n)`` at each size n of ``sizes`` (core.timing's timer, interleaved
    warm-up). ``monotone``: the running maximum of the medians (timing noise can make a larger
    forward look faster; the cost model needs a curve that does not fall)."""
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"measure_curve: sizes must be integers >= 1, got {sizes}")
    seconds = [time_forward(lambda n=n: forward(n), repeats=repeats, warmup=warmup).median for n in sizes]
    if monotone:
        seconds = [max(seconds[: i + 1]) for i in range(len(seconds))]
    return tuple(map(float, sizes)), tuple(seconds)


def measure_step_costs(target_forward: Callable[[int], object], draft_forward: Callable[[int], object],
                       token_counts: Sequence[int], batch_sizes: Sequence[int], *, repeats: int = 5,
                       warmup: int = 1, monotone: bool = True, meta: dict | None = None) -> StepCosts:
    """:class:`StepCosts` measured: ``target_forward(n)`` runs the target over n scheduled tokens,
    ``draft_forward(b)`` one draft pass over b rows (each a callable of the real models at start-up;
    any callable in tests)."""
    began = time.perf_counter()
    tt, ts = measure_curve(target_forward, token_counts, repeats=repeats, warmup=warmup, monotone=monotone)
    db, ds = measure_curve(draft_forward, batch_sizes, repeats=repeats, warmup=warmup, monotone=monotone)
    info = {"machine": machine_description(), "date": time.strftime("%Y-%m-%d"), "repeats": repeats,
            "measure_seconds": round(time.perf_counter() - began, 3), **(meta or {})}
    return StepCosts(tt, ts, db, ds, meta=info)


def check_accept_probs(accept_probs, name: str = "accept_probs") -> torch.Tensor:
    """[R, K] float64 conditional acceptance probabilities: 2-D, at least one row, each in [0, 1]."""
    a = torch.as_tensor(accept_probs, dtype=torch.float64)
    if a.dim() != 2 or a.shape[0] == 0:
        raise ValueError(f"{name} must be a [requests, positions] table with at least one request, got shape "
                         f"{tuple(a.shape)}")
    if a.numel() and (torch.isnan(a).any() or (a < 0).any() or (a > 1).any()):
        raise ValueError(f"{name} must hold probabilities in [0, 1] (no NaN), got values from "
                         f"{float(a.nan_to_num(nan=-1).min())} to {float(a.nan_to_num(nan=2).max())}")
    return a


def check_caps(max_lengths, rows: int, positions: int, name: str = "max_lengths") -> torch.Tensor:
    """[R] int64 caps on each row's length, in 0..positions (default: positions for every row)."""
    if max_lengths is None:
        return torch.full((rows,), positions, dtype=torch.long)
    caps = torch.as_tensor(max_lengths)
    if caps.shape != (rows,) or caps.is_floating_point() or caps.dtype == torch.bool:
        raise ValueError(f"{name} must be {rows} integers (one per request), got {max_lengths!r}")
    caps = caps.long()
    if (caps < 0).any() or (caps > positions).any():
        raise ValueError(f"{name} must lie in 0..{positions} (the positions of accept_probs), got {caps.tolist()}")
    return caps


def check_mode(draft: str) -> str:
    if draft not in DRAFT_MODES:
        raise ValueError(f"draft must be one of {DRAFT_MODES} ('dense': a pass costs draft(batch) while any row "
                         f"drafts, vLLM's loop; 'active': draft(rows still drafting)), got {draft!r}")
    return draft


@dataclass(frozen=True)
class LengthChoice:
    """A step's chosen lengths, its expected committed tokens, its modelled seconds and their ratio."""

    lengths: tuple[int, ...]
    committed: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.committed / self.seconds if self.seconds > 0 else math.inf


def step_seconds(lengths, costs: StepCosts, draft: str = "dense", sunk_passes: int = 0,
                 sunk_seconds: float = 0.0, extra_tokens: int = 0) -> float:
    """The modelled seconds of a step with these lengths: target(sum (L_r + 1) + extra_tokens) plus the
    draft passes after ``sunk_passes`` (dense: draft(B) each while a row drafts; active: draft(n_k)) plus
    ``sunk_seconds`` (the passes already run)."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    rows = lengths.numel()
    tokens = int(lengths.sum()) + rows + extra_tokens
    longest = int(lengths.max()) if rows else 0
    passes = torch.arange(sunk_passes + 1, longest + 1)
    if draft == "dense":
        drafted = float(costs.draft(rows)) * passes.numel() if rows else 0.0
    else:
        counts = (lengths.unsqueeze(0) >= passes.unsqueeze(1)).sum(1)
        drafted = float(costs.draft(counts).sum())
    return float(costs.target(tokens)) + drafted + sunk_seconds


def expected_committed(accept_probs, lengths) -> float:
    """sum_r E_r(L_r) = sum_r (1 + sum_{k <= L_r} prod_{i <= k} a[r, i])."""
    a = check_accept_probs(accept_probs)
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    p = torch.cumprod(a, dim=1)
    keep = torch.arange(1, a.shape[1] + 1).unsqueeze(0) <= lengths.unsqueeze(1)
    return float(a.shape[0] + (p * keep).sum())


def _plan(p: torch.Tensor, free_from: torch.Tensor, caps: torch.Tensor, costs: StepCosts, draft: str,
          base_committed: float, base_tokens: int, sunk_passes: int, sunk_seconds: float,
          batch: int, search: bool = True) -> LengthChoice:
    """The lengths (>= free_from - 1, <= caps) maximising (base + committed) / seconds, where rows are
    already fixed up to position free_from - 1 and their cells there counted in ``base_committed`` and
    ``base_tokens``; ``p`` [R, K] are the cells' all-accepted probabilities (module docstring)."""
    rows, positions = p.shape
    pos = torch.arange(1, positions + 1).expand(rows, positions)
    free = (pos >= free_from.unsqueeze(1)) & (pos <= caps.unsqueeze(1))
    fixed = free_from - 1
    target_at = costs.target
    draft_b = float(costs.draft(batch))
    best_rate, best = -math.inf, None
    top = int(caps.max()) if rows else 0
    # every free cell, by P descending (ties in position order): each M's candidates are a subsequence
    order = torch.sort(p[free], descending=True, stable=True).indices
    all_values, all_where = p[free][order], pos[free][order]
    all_owners = torch.arange(rows).unsqueeze(1).expand(rows, positions)[free][order]
    for longest in range(sunk_passes, max(top, sunk_passes) + 1):
        cells = all_where <= longest
        values, where, owners = all_values[cells], all_where[cells], all_owners[cells]
        taken = torch.arange(values.numel() + 1, dtype=torch.float64)
        committed = base_committed + torch.cat([values.new_zeros(1), torch.cumsum(values, 0)])
        seconds = target_at(base_tokens + taken) + sunk_seconds
        if draft == "dense":
            # a pass beyond the sunk ones runs while any row has a candidate there
            reach = torch.cat([torch.zeros(1, dtype=torch.long), torch.cummax(where, 0).values]) if where.numel() \
                else torch.zeros(1, dtype=torch.long)
            reach = torch.maximum(reach, torch.tensor(sunk_passes))
            seconds = seconds + (reach - sunk_passes).double() * draft_b
        else:
            later = where > sunk_passes
            onehot = torch.zeros(values.numel() + 1, positions, dtype=torch.float64)
            if where.numel():
                onehot[torch.arange(1, values.numel() + 1)[later], (where[later] - 1)] = 1.0
            counts = torch.cumsum(onehot, 0)
            seconds = seconds + costs.draft(counts).sum(1)
        rate = committed / seconds
        j = int(torch.argmax(rate))
        if float(rate[j]) > best_rate + 1e-15 * abs(best_rate if math.isfinite(best_rate) else 0.0):
            lengths = fixed.clone()
            if j:
                lengths.scatter_reduce_(0, owners[:j], where[:j], reduce="amax")
            best_rate, best = float(rate[j]), (lengths, float(committed[j]), float(seconds[j]))
    lengths, committed, seconds = best
    if search and draft == "active" and not costs.draft_is_affine:
        lengths, committed, seconds = _local_search(p, lengths, fixed, caps, costs, base_committed, base_tokens,
                                                    sunk_passes, sunk_seconds, committed, seconds)
    return LengthChoice(tuple(int(n) for n in lengths), committed, seconds)


def _local_search(p, lengths, fixed, caps, costs, base_committed, base_tokens, sunk_passes, sunk_seconds,
                  committed, seconds):
    """Set one row to another length while that raises the rate (active mode with a
    draft curve that is not affine, where the enumeration alone is not exact)."""
    def value(ls):
        keep = torch.arange(1, p.shape[1] + 1).unsqueeze(0) <= ls.unsqueeze(1)
        freshly = keep & (torch.arange(1, p.shape[1] + 1).unsqueeze(0) > fixed.unsqueeze(1))
        c = base_committed + float((p * freshly).sum())
        passes = torch.arange(sunk_passes + 1, p.shape[1] + 1)
        counts = (ls.unsqueeze(0) >= passes.unsqueeze(1)).sum(1)
        s = float(costs.target(base_tokens + int((ls - fixed).sum()))) + sunk_seconds + float(costs.draft(counts).sum())
        return c, s

    rate = committed / seconds
    improved = True
    while improved:
        improved = False
        for r in range(lengths.numel()):
            for n in range(int(fixed[r]), int(caps[r]) + 1):
                if n == int(lengths[r]):
                    continue
                trial = lengths.clone()
                trial[r] = n
                c, s = value(trial)
                if c / s > rate * (1 + 1e-12):
                    lengths, committed, seconds, rate, improved = trial, c, s, c / s, True
    return lengths, committed, seconds


def choose_lengths(accept_probs, costs: StepCosts, max_lengths=None, draft: str = "dense") -> LengthChoice:
    """The lengths L_r in 0..max_lengths[r] (default: the positions of ``accept_probs`` [R, K]) that
    maximise the step's expected committed tokens per second (module docstring: the model, the search
    and when it is exact). ``draft``: ``"dense"`` (vLLM's loop) or ``"active"``."""
    if not isinstance(costs, StepCosts):
        raise TypeError(f"costs must be a StepCosts, got {type(costs).__name__}")
    draft = check_mode(draft)
    a = check_accept_probs(accept_probs)
    rows, positions = a.shape
    caps = check_caps(max_lengths, rows, positions)
    p = torch.cumprod(a, dim=1)
    return _plan(p, torch.ones(rows, dtype=torch.long), caps, costs, draft, float(rows), rows, 0, 0.0, rows)


class OnlineLengths:
    """:func:`choose_lengths` decided pass by pass inside a draft loop of ``batch`` rows and at most
    ``max_len`` passes. After pass k call :meth:`step` with each row's estimate ``a[b]`` that its k-th
    candidate is accepted (given the earlier ones); it re-plans the step with the passes so far paid for
    and every later acceptance of a row predicted as its estimate ``a[b]`` repeating, and answers
    ``(keep, more)``: row b keeps its k-th candidate, and drafts a (k+1)-th. ``lengths`` holds the
    decided lengths (a row that does not keep its k-th candidate ends at k - 1).

    Exactness under sampling: whether a candidate is verified may depend on everything drafted before
    it, not on the candidate itself (dropping y_k because of y_k biases the output). So a k-th
    candidate is dropped only with ``droppable=True``, for estimates computed before y_k was drawn (the
    online estimator's feature, a function of q_k); otherwise (a lag-free head reads y_k) it is kept and
    only ``more``, the decision on candidate k + 1, is made from it."""

    def __init__(self, costs: StepCosts, batch: int, max_len: int, draft: str = "dense") -> None:
        if not isinstance(costs, StepCosts):
            raise TypeError(f"costs must be a StepCosts, got {type(costs).__name__}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"OnlineLengths: batch must be an integer >= 1, got {batch!r}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"OnlineLengths: max_len must be an integer >= 1, got {max_len!r}")
        self.costs, self.batch, self.max_len, self.draft = costs, batch, max_len, check_mode(draft)
        self.k = 0
        self.p = torch.ones(batch, dtype=torch.float64)  # P[b, k] of each row's latest kept candidate
        self.lengths = torch.zeros(batch, dtype=torch.long)  # decided (or so far kept) candidates
        self.drafting = torch.ones(batch, dtype=torch.bool)
        self.committed = float(batch)  # 1 per row + the kept candidates' P
        self.sunk = 0.0  # seconds of the passes run

    def step(self, accept, caps=None, droppable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """After pass k (``k = 1, 2, ...``): ``accept`` [batch] the rows' estimates for their k-th candidate
        (read only for rows still drafting), ``caps`` [batch] (optional) the most candidates each may keep
        (the stop policy's stop: a row capped at k drafts no more). ``droppable``: the estimates did not
        read the k-th candidates, which may then be dropped (class docstring). Returns bool tensors
        ``keep`` and ``more`` [batch], False for rows that had stopped."""
        k = self.k + 1
        if k > self.max_len:
            raise ValueError(f"OnlineLengths: pass {k} is beyond max_len={self.max_len}")
        a = torch.as_tensor(accept, dtype=torch.float64).reshape(-1)
        if a.numel() != self.batch:
            raise ValueError(f"accept must hold {self.batch} estimates (one per row), got {a.numel()}")
        active = self.drafting.clone()
        a = check_accept_probs(torch.where(active, a, 0.0).reshape(1, -1), "accept")[0]  # stopped rows: unread
        caps = torch.full((self.batch,), self.max_len, dtype=torch.long) if caps is None else \
            check_caps(caps, self.batch, self.max_len, "caps")
        self.k = k
        self.sunk += float(self.costs.draft(self.batch if self.draft == "dense" else int(active.sum())))
        pk = self.p * a  # P[b, k] for active rows
        committed, tokens = self.committed, self.batch + int(self.lengths.sum())
        if not droppable:  # the k-th candidates stay: fixed, as the earlier ones
            kept = active & (caps >= k)
            committed += float(pk[kept].sum())
            tokens += int(kept.sum())
            self._keep(kept, pk, k)
            active = kept
        pos = torch.arange(1, self.max_len + 1, dtype=torch.float64)
        # cell k known, later cells predicted as a repeating: P[b, j] = P[b, k] a^(j - k)
        grid = pk.unsqueeze(1) * a.unsqueeze(1).pow((pos - k).clamp(min=0))
        grid = torch.where(pos.unsqueeze(0) >= k, grid, 1.0)
        first = k if droppable else k + 1
        free_from = torch.where(active, torch.tensor(first), self.lengths + 1)
        row_caps = torch.where(active, torch.maximum(caps, torch.tensor(first - 1)), self.lengths)
        plan = _plan(grid, free_from, row_caps, self.costs, self.draft, committed, tokens, k, self.sunk, self.batch)
        planned = torch.tensor(plan.lengths, dtype=torch.long)
        keep = active & (planned >= k)
        if droppable:
            self.committed = committed + float(pk[keep].sum())
            self._keep(keep, pk, k)
        else:
            self.committed = committed
        more = keep & (planned > k) & (k < self.max_len)
        self.drafting = more
        return keep, more

    def end(self, rows) -> torch.Tensor:
        """Rows ``rows`` [batch] (bool) draft no more after the candidates they keep (a stop policy's stop
        made after the pass's plan); returns the rows still drafting."""
        self.drafting = self.drafting & ~torch.as_tensor(rows, dtype=torch.bool).reshape(-1)
        return self.drafting.clone()

    def _keep(self, rows: torch.Tensor, pk: torch.Tensor, k: int) -> None:
        self.lengths = torch.where(rows, torch.tensor(k), self.lengths)
        self.p = torch.where(rows, pk, self.p)

    @property
    def done(self) -> bool:
        return not bool(self.drafting.any()) or self.k >= self.max_len
