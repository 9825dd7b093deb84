"""Token trees as data: the shape a tree decoder drafts and verifies every round.

A :class:`TokenTree` is a list of parent indices in breadth-first order, one per drafted node,
``-1`` meaning the root (the last committed token): ``[-1, -1, 0, 0, 1]`` is two root children, two
children under the first and one under the second; a chain of K is ``[-1, 0, 1, ..., K-2]``.
Children of a node are in sampling order (the first child is the draft's first draw). Breadth-first
order with each node's children together is exactly "parent indices never decrease", so levels are
contiguous ranges and a tree cut at a depth is a prefix of the list.

Sizes follow Sequoia: ``size`` counts the root (``n`` in the paper; a tree of size n drafts n - 1
tokens and the target scores n), ``depth`` counts the root's level too (a chain of K has depth K + 1).

Saved as JSON: ``{"schema": "specdecpp.tree/1", "parents": [...], ...}`` (any other keys are kept
as ``meta``: what chose the tree); :meth:`TokenTree.load` also reads a plain JSON list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path

import torch

from ..core.jsonfile import read_json

SCHEMA = "specdecpp.tree/1"


class TokenTree:
    """An ordered tree of drafted nodes under the root. ``parents[i]`` is node i's parent (-1: the
    root); nodes are in breadth-first order with each node's children together, in sampling order."""

    def __init__(self, parents: Sequence[int] | TokenTree, meta: Mapping | None = None) -> None:
        if isinstance(parents, TokenTree):
            parents, meta = parents.parents, {**parents.meta, **(meta or {})}
        self.parents = check_parents(parents)
        self.meta = dict(meta or {})

    # -- shapes ---------------------------------------------------------------------------------

    @classmethod
    def chain(cls, k: int) -> TokenTree:
        """K drafted tokens in a row (speculative decoding's block of K)."""
        _check_int("TokenTree.chain: k", k, 0)
        return cls([i - 1 for i in range(k)])

    @classmethod
    def star(cls, width: int) -> TokenTree:
        """``width`` root children and nothing below (the acceptance vector's measurement)."""
        _check_int("TokenTree.star: width", width, 0)
        return cls([-1] * width)

    @classmethod
    def from_branching(cls, branching: Sequence[Sequence[int]]) -> TokenTree:
        """Level by level, the child count of each node of the level above (root level first):
        ``[[2], [2, 1]]`` is ``[-1, -1, 0, 0, 1]``."""
        parents, level = [], [-1]
        for depth, counts in enumerate(branching):
            if len(counts) != len(level):
                raise ValueError(f"TokenTree.from_branching: level {depth} gives {len(counts)} child counts for "
                                 f"{len(level)} nodes")
            nxt = []
            for node, c in zip(level, counts, strict=True):
                _check_int(f"TokenTree.from_branching: level {depth} count", c, 0)
                nxt += list(range(len(parents), len(parents) + c))
                parents += [node] * c
            level = nxt
        return cls(parents)

    # -- properties -----------------------------------------------------------------------------

    @property
    def n_nodes(self) -> int:
        """Drafted nodes (the root not counted)."""
        return len(self.parents)

    @property
    def size(self) -> int:
        """Sequoia's n: the nodes the target scores, the root included."""
        return len(self.parents) + 1

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth below the root (root children: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return tuple(out)

    @property
    def depth(self) -> int:
        """Levels including the root's (Sequoia's d): 1 for an empty tree, K + 1 for a chain of K."""
        return (self.depths[-1] if self.parents else 0) + 1

    @cached_property
    def children(self) -> dict[int, tuple[int, ...]]:
        """``children[node]`` in sampling order; ``children[-1]`` are the root's."""
        out: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self.parents):
            out.setdefault(i, [])
            out[p].append(i)
        return {k: tuple(v) for k, v in out.items()}

    @property
    def branching(self) -> int:
        """The largest number of children of one node."""
        return max(len(c) for c in self.children.values())

    @cached_property
    def levels(self) -> tuple[range, ...]:
        """The node indices of each depth 1, 2, ... (contiguous in breadth-first order)."""
        out, start = [], 0
        for i in range(1, self.n_nodes + 1):
            if i == self.n_nodes or self.depths[i] != self.depths[start]:
                out.append(range(start, i))
                start = i
        return tuple(out)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Each node's position among its siblings, 1-based (the k of the acceptance vector p_k)."""
        return tuple(self.children[p].index(i) + 1 for i, p in enumerate(self.parents))

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (inclusive)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """Bool [N, N]: ``mask[i, j]`` iff node j is node i or one of its ancestors."""
        mask = torch.eye(self.n_nodes, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] |= mask[p]
        return mask.to(device)

    def truncated(self, max_depth: int) -> TokenTree:
        """The nodes at most ``max_depth`` below the root (a prefix in breadth-first order)."""
        if max_depth >= self.depth - 1:
            return self
        return TokenTree(self.parents[: sum(1 for d in self.depths if d <= max_depth)], self.meta)

    def expected_tokens(self, acceptance: Sequence[float]) -> float:
        """Sequoia's F(T): the expected tokens per round (accepted nodes + the target's token) when
        the k-th child of an accepted node is the accepted one with probability ``acceptance[k-1]``
        (the positional acceptance assumption)."""
        p = [float(x) for x in acceptance]
        if self.branching > len(p):
            raise ValueError(f"expected_tokens: the tree has a node with {self.branching} children but the "
                             f"acceptance vector only {len(p)} entries")
        score: list[float] = []
        for i, parent in enumerate(self.parents):
            score.append((1.0 if parent < 0 else score[parent]) * p[self.ranks[i] - 1])
        return 1.0 + sum(score)

    # -- JSON -----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "parents": list(self.parents), "size": self.size, "depth": self.depth,
                **{k: v for k, v in self.meta.items() if k not in ("schema", "parents", "size", "depth")}}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data, where: str = "tree") -> TokenTree:
        if isinstance(data, list):
            return cls(data)
        if not isinstance(data, dict) or "parents" not in data:
            raise ValueError(f"{where}: expected a JSON list of parent indices or an object with 'parents', "
                             f"got {type(data).__name__}")
        if data.get("schema", SCHEMA) != SCHEMA:
            raise ValueError(f"{where}: unknown schema {data['schema']!r} (this version reads {SCHEMA!r})")
        try:
            tree = cls(data["parents"], {k: v for k, v in data.items() if k not in ("schema", "parents")})
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        for key in ("size", "depth"):
            if key in data and data[key] != getattr(tree, key):
                raise ValueError(f"{where}: says {key} {data[key]} but its parents give {getattr(tree, key)}")
        return tree

    @classmethod
    def load(cls, path: str | Path) -> TokenTree:
        """Read a tree file (the object :meth:`save` writes, or a plain list of parents)."""
        path = Path(path)
        data = read_json(path, "tree file", "write one with `python -m infer.sequoia tree`")
        return cls.from_dict(data, f"tree file {str(path)!r}")

    @classmethod
    def coerce(cls, tree) -> TokenTree:
        """A TokenTree from a tree, a list of parents or a tree file's path."""
        if isinstance(tree, TokenTree):
            return tree
        if isinstance(tree, (str, Path)):
            return cls.load(tree)
        if isinstance(tree, Sequence):
            return cls(tree)
        raise TypeError(f"tree must be a TokenTree, a list of parent indices or a tree JSON file, got "
                        f"{type(tree).__name__}")

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenTree) and self.parents == other.parents

    def __hash__(self) -> int:
        return hash(self.parents)

    def __repr__(self) -> str:
        return f"TokenTree(size={self.size}, depth={self.depth}, parents={list(self.parents)})"


def check_parents(parents) -> tuple[int, ...]:
    """The parents list, checked: integers, each -1 or an earlier node, never decreasing."""
    if isinstance(parents, (str, bytes)) or not isinstance(parents, Sequence):
        raise ValueError(f"a token tree is a list of parent indices (-1 for the root), got {type(parents).__name__}")
    out = []
    for i, p in enumerate(parents):
        if isinstance(p, bool) or not isinstance(p, int):
            raise ValueError(f"token tree: parent of node {i} must be an integer, got {p!r}")
        if not -1 <= p < i:
            raise ValueError(f"token tree: parent of node {i} is {p}; it must be -1 (the root) or an earlier node "
                             f"(0..{i - 1})")
        if out and p < out[-1]:
            raise ValueError(f"token tree: nodes must be in breadth-first order with siblings together (parents "
                             f"never decrease), but node {i} has parent {p} after node {i - 1}'s parent {out[-1]}")
        out.append(p)
    return tuple(out)


def _check_int(what: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
