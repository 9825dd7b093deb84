"""Sequoia's tree choice (methods/sequoia.md, sections 1 and 3): the bounded-depth dynamic program
for the best tree under the positional acceptance assumption, and the hardware-aware choice of its
size and depth from measured costs.

- Acceptance vector ``p = (p_1, ..., p_W)``: ``p_k`` is the probability that the k-th child (in
  sampling order) of an accepted node is the accepted one; sum p_k <= 1.
- A tree's score F(T) = sum over its nodes of prod of p along the path (the root counts 1): the
  expected tokens per round (:meth:`TokenTree.expected_tokens`).
- ``T[m][l][b]``: the best score of a tree of m nodes (root included), depth <= l levels (root's
  included), b root children: ``T[1][l][0] = 1``; ``T[m][l][1] = 1 + p_1 max_j T[m-1][l-1][j]``;
  ``T[m][l][b] = max_{1<=y<m} T[y][l][b-1] + p_b max_j T[m-y][l-1][j]``; G(n, d) = max_b T[n][d][b].
  O(n^2 d W) with numpy over y.
- The choice: the (n, d) maximising G(n, d) / (t_target(n) + the draft's forwards for that tree),
  where t_target(n) is the measured width curve and the draft's cost is the sum, over its forwards
  (the root, then each level's nodes that have children), of the measured draft cost of that many
  tokens (``Costs.draft_cost``). The paper's d * c is this sum with every level costing one token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..decoders.tree import TokenTree
from .costmodel import Costs


def check_acceptance(acceptance) -> np.ndarray:
    p = np.asarray(acceptance, dtype=float)
    if p.ndim != 1 or p.size == 0 or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() > 1 + 1e-9:
        raise ValueError(f"acceptance vector must be a non-empty list of probabilities p_1..p_W with sum <= 1, "
                         f"got {list(np.atleast_1d(p))}")
    return p


class TreeDP:
    """The bounded-depth DP up to ``max_size`` nodes (root included) and ``max_depth`` levels."""

    def __init__(self, acceptance: Sequence[float], max_size: int, max_depth: int) -> None:
        for name, v in (("max_size", max_size), ("max_depth", max_depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TreeDP: {name} must be an integer >= 1, got {v!r}")
        self.p = check_acceptance(acceptance)
        self.max_size, self.max_depth = max_size, max_depth
        m_, l_, k_ = max_size + 1, max_depth + 1, self.p.size + 1
        t = np.full((m_, l_, k_), -np.inf)
        choice = np.zeros((m_, l_, k_), dtype=int)
        best = np.full((m_, l_), -np.inf)
        for depth in range(1, l_):
            t[1, depth, 0] = best[1, depth] = 1.0
            for m in range(2, m_):
                if depth >= 2:
                    sub = best[m - 1, depth - 1]
                    t[m, depth, 1] = 1.0 + self.p[0] * sub if np.isfinite(sub) else -np.inf
                    ys = np.arange(1, m)
                    for b in range(2, k_):
                        sub = best[m - ys, depth - 1]
                        vals = np.where(np.isfinite(sub), t[ys, depth, b - 1] + self.p[b - 1] * np.where(
                            np.isfinite(sub), sub, 0.0), -np.inf)
                        j = int(np.argmax(vals))
                        t[m, depth, b], choice[m, depth, b] = vals[j], ys[j]
                best[m, depth] = t[m, depth].max()
        self.table, self.choice, self.best = t, choice, best

    def value(self, n: int, d: int) -> float:
        """G(n, d): the best expected tokens per round of a tree of n nodes (root included) and at
        most d levels; -inf where no such tree has branching <= W."""
        self._check(n, d)
        return float(self.best[n, d])

    def _check(self, n: int, d: int) -> None:
        if not (1 <= n <= self.max_size and 1 <= d <= self.max_depth):
            raise ValueError(f"TreeDP: (n, d) = ({n}, {d}) is outside the table (n <= {self.max_size}, "
                             f"d <= {self.max_depth})")

    def _child_sizes(self, m: int, depth: int) -> list[int]:
        b = int(np.argmax(self.table[m, depth]))
        sizes = []
        for bb in range(b, 1, -1):
            y = int(self.choice[m, depth, bb])
            sizes.append(m - y)
            m = y
        if b >= 1:
            sizes.append(m - 1)
        return sizes[::-1]

    def tree(self, n: int, d: int) -> TokenTree:
        """A tree attaining G(n, d), breadth first, children in sampling order."""
        if not math.isfinite(self.value(n, d)):
            raise ValueError(f"TreeDP: no tree of size {n} within depth {d} with at most {self.p.size} children "
                             "per node")
        parents, queue = [], [(-1, n, d)]
        while queue:
            node, m, depth = queue.pop(0)
            for size in self._child_sizes(m, depth):
                parents.append(node)
                queue.append((len(parents) - 1, size, depth - 1))
        return TokenTree(parents, {"acceptance": self.p.tolist(), "expected_tokens": self.value(n, d)})


@dataclass(frozen=True)
class Candidate:
    """One (n, d) the optimiser weighed: G(n, d), the target's and the draft's measured seconds per
    round for that tree, the draft forwards' widths, and the predicted speedup over target-only."""

    size: int
    depth: int
    expected_tokens: float
    target_s: float
    draft_s: float
    draft_widths: tuple[int, ...]
    speedup: float

    def to_dict(self) -> dict:
        return {**asdict(self), "draft_widths": list(self.draft_widths)}


def draft_widths(tree: TokenTree) -> tuple[int, ...]:
    """The tokens of each draft forward of a round: the root, then each level's nodes with children."""
    if not tree.n_nodes:
        return ()
    return (1, *(w for w in (sum(1 for v in level if tree.children[v]) for level in tree.levels) if w))


def round_cost(tree: TokenTree, costs: Costs) -> tuple[float, float]:
    """(target seconds, draft seconds) of one round with ``tree``, from the measured curves."""
    draft = sum(costs.draft_cost(w) for w in draft_widths(tree))
    return costs.target_cost(tree.size), float(draft)


def choose_tree(acceptance: Sequence[float], costs: Costs, sizes: Sequence[int] | None = None,
                max_depth: int = 12) -> tuple[TokenTree, list[Candidate]]:
    """The tree of the (n, d) with the best predicted speedup G(n, d) / (t_target(n) + draft cost) x
    t_target(1), over ``sizes`` (default: the widths the target's curve was measured at) and
    d <= ``max_depth``; returns it and every candidate weighed (best first)."""
    measured = sorted(int(n) for n in (costs.target_by_width or {}))
    sizes = sorted({int(n) for n in (sizes or measured)})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"choose_tree: sizes must be integers >= 1, got {sizes}")
    if not measured or sizes[-1] > measured[-1]:
        raise ValueError(f"choose_tree: the target's cost is measured up to width {measured[-1] if measured else 0}, "
                         f"so trees of size {sizes[-1]} cannot be priced (measure wider: python -m infer.costs "
                         "--max-width N)")
    dp = TreeDP(acceptance, sizes[-1], max_depth)
    base = costs.target_cost(1)
    out = []
    for n in sizes:
        for d in range(1, max_depth + 1):
            g = dp.value(n, d)
            if not math.isfinite(g):
                continue
            tree = dp.tree(n, d)
            if tree.depth < d:  # a deeper bound gives nothing more than this tree already has
                continue
            target_s, draft_s = round_cost(tree, costs)
            out.append(Candidate(n, d, g, target_s, draft_s, draft_widths(tree), g * base / (target_s + draft_s)))
    out.sort(key=lambda c: -c.speedup)
    best = out[0]
    tree = dp.tree(best.size, best.depth)
    tree.meta.update(predicted_speedup=best.speedup, target_s=best.target_s, draft_s=best.draft_s)
    return tree, out
