"""Sequoia (Chen et al., arXiv 2402.12374): speculative decoding with a token tree, on the round core
(specdecpp/decoders/rounds.py).

A round, with ``n`` committed tokens (``tokens[n - 1]``, the root, in neither cache):

- :class:`TreeDrafter` grows the :class:`~specdecpp.decoders.tree.TokenTree` level by level: one draft
  forward over the root, then one over each level's nodes that have children (tree attention
  mask, position = the root's + depth). A node's children are drawn **without replacement** from
  its warped draft distribution ``q`` by Gumbel top-k (key order = child order; the draft's top
  tokens under greedy decoding), and uniformly from the tokens outside ``q``'s support once that
  is used up.
- :func:`score_tree`: the target scores the root and every node in one forward with the tree mask.
- :class:`TreeRule` walks from the root node by node with Sequoia's rule (methods/sequoia.md, Alg. 1):
  child ``x`` of the current node is accepted with ``min(1, R(x) / D(x))``, ``R`` starting as the
  node's target distribution ``p`` and ``D`` as its ``q``; on a rejection ``R <- Norm[(R - D)+]``
  with the current ``D``, then ``x`` leaves ``D`` (uniform over the tokens not yet drawn if ``D``
  empties) and ``D`` is renormalised. An accepted child becomes the current node; a leaf or a node
  whose children are all rejected samples the round's final token from ``R``. Greedy: a child is
  accepted iff it is the target's argmax. The output has exactly the target's warped distribution.
- ``Sequence.commit`` writes the accepted path and the final token (EOS cut, length limit), both
  caches keep the prefix and the accepted path's entries (:meth:`ModelRunner.compact`), and
  ``RunStats.add_round`` counts the round.

Near the length limit the tree is cut to the depth the remaining room allows (a prefix of it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..core.attention import decoding
from ..core.sampling import SamplingConfig, argmax, draw_token, warp
from ..core.timing import Clock
from ..core.verify import residual
from ..fast.buckets import GRAPH_BACKENDS, check_fast
from ..fast.calls import CallRunners
from ..fast.features import fast_feature_runners
from ..models.feature_runner import feature_pair, refuse_feature_draft
from ..models.reduced_vocab import output_vocab_size
from ..models.runner import ModelRunner
from .rounds import (
    FastPlanned,
    GenerateOutput,
    RunStats,
    check_pair_devices,
    finish,
    start_generate,
)
from .tree import TokenTree

TREE_ATTENTION = ("eager", "sdpa")  # attention implementations that take a custom 4-D mask


@dataclass
class SequoiaStats(RunStats):
    """:class:`RunStats` of a tree decoder. Per round, ``candidate_lengths`` holds the tree's
    drafted nodes (all scored by the target) and ``accept_lengths`` the accepted path's length;
    ``n_draft_calls`` counts draft forwards (one per level), ``draft_widths`` the tokens each fed
    (``n_draft_tokens`` their sum); ``accepted_ranks[r]`` lists the sibling rank (1 = first drawn)
    of each accepted node."""

    tree_size: int = 0
    tree_depth: int = 0
    n_draft_tokens: int = 0
    draft_widths: list[int] = field(default_factory=list)
    accepted_ranks: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_target_call(self) -> float:
        return self.n_generated / max(self.n_target_calls, 1)


@dataclass
class TreePlan:
    """What a round needs of a tree, computed once per tree: the draft's forwards (the nodes with
    children of each level, their cache slots after the root and masks over those slots) and the
    target's ancestor mask and depths."""

    tree: TokenTree
    fed: list[list[int]]  # per depth 1..: the level's nodes that have children (fed to the draft)
    slot: dict[int, int]  # node -> its draft-cache position after the root
    level_masks: list[torch.Tensor]  # per fed level: bool [m, fed before + m] over the fed slots
    counts: list[list[int]]  # per draft forward (root first): the child count of each fed node
    ancestors: torch.Tensor  # bool [N, N]
    depths: torch.Tensor  # long [N]

    @classmethod
    def build(cls, tree: TokenTree, device) -> TreePlan:
        fed, slot, masks = [], {}, []
        anc = tree.ancestor_mask()
        for level in tree.levels:
            nodes = [v for v in level if tree.children[v]]
            if not nodes:
                break
            before = len(slot)
            mask = torch.zeros(len(nodes), before + len(nodes), dtype=torch.bool)
            for j, v in enumerate(nodes):
                for a in tree.path(v)[:-1]:
                    mask[j, slot[a]] = True
                mask[j, before + j] = True
            slot.update({v: before + j for j, v in enumerate(nodes)})
            fed.append(nodes)
            masks.append(mask.to(device))
        counts = [[len(tree.children[-1])]] + [[len(tree.children[v]) for v in nodes] for nodes in fed]
        return cls(tree, fed, slot, masks, counts, anc.to(device), torch.tensor(tree.depths, dtype=torch.long,
                                                                                  device=device))

    @property
    def n_draft_forwards(self) -> int:
        return len(self.fed) + 1 if self.tree.n_nodes else 0


@dataclass
class TreeBlock:
    """A drafted tree: ``tokens`` [N] and, unless greedy, ``q[node]`` (the warped draft row the
    node's children were drawn from; ``q[-1]`` is the root's); ``widths``: each draft forward's tokens."""

    tokens: torch.Tensor
    q: dict
    widths: list[int]
    t0: float
    t1: float


def gumbel_top_k(q: torch.Tensor, k: int, gen: torch.Generator | None) -> torch.Tensor:
    """For each row of ``q`` [m, V], ``k`` tokens drawn without replacement, in draw order
    (Gumbel top-k: the largest keys log q + Gumbel noise). Once a row's support is used up the rest
    are drawn uniformly, without replacement, from the tokens outside it. Returns [m, k]."""
    u = torch.rand(q.shape, generator=gen, device=q.device).clamp_min_(torch.finfo(torch.float32).tiny)
    keys = q.log() - (-u.log()).log()
    top = keys.topk(k, dim=-1).indices
    support = (q > 0).sum(-1, keepdim=True)
    if int(support.min()) >= k:
        return top
    rest = torch.rand(q.shape, generator=gen, device=q.device).masked_fill_(q > 0, -1.0).topk(k, dim=-1).indices
    j = torch.arange(k, device=q.device)
    shifted = rest.gather(-1, (j - support).clamp_min(0))
    return torch.where(j < support, top, shifted)


class TreeDrafter:
    """Grows a tree with the draft model: one forward over the root, then one over each level's
    nodes that have children, drawing the children as the module docstring says."""

    def __init__(self, runner: ModelRunner, sampling: SamplingConfig, clock: Clock) -> None:
        self.runner, self.sampling, self.clock = runner, sampling, clock

    def _children(self, logits: torch.Tensor, counts: list[int], gen) -> tuple[torch.Tensor, torch.Tensor | None]:
        k = max(counts)
        if self.sampling.greedy:
            q, top = None, logits.topk(k, dim=-1).indices
        else:
            q = warp(logits, self.sampling)
            top = gumbel_top_k(q, k, gen)
        if min(counts) == k:
            return top.reshape(-1), q
        keep = torch.arange(k, device=top.device) < torch.tensor(counts, device=top.device)[:, None]
        return top[keep], q

    def grow(self, seq: torch.Tensor, n: int, plan: TreePlan, gen: torch.Generator | None) -> TreeBlock:
        """Draft ``plan.tree`` after the committed ``seq[:n]`` (the root is ``seq[n - 1]``)."""
        t0, tree, runner = self.clock.now(), plan.tree, self.runner
        tokens = torch.empty(tree.n_nodes, dtype=torch.long, device=seq.device)
        q_rows, widths = {}, []
        if tree.n_nodes:
            widths.append(n - runner.length)
            logits = runner.feed(seq[runner.length : n])[0]
            for depth, (counts, level) in enumerate(zip(plan.counts, tree.levels, strict=False)):
                parents = [-1] if depth == 0 else plan.fed[depth - 1]
                if depth:
                    mask = plan.level_masks[depth - 1]
                    prefix = torch.ones(len(parents), n, dtype=torch.bool, device=seq.device)
                    positions = torch.full((len(parents),), n - 1 + depth, device=seq.device)
                    logits = runner.feed(tokens[parents], len(parents), positions, torch.cat([prefix, mask], 1))[0]
                    widths.append(len(parents))
                tokens[level.start : level.stop], q = self._children(logits, counts, gen)
                if q is not None:
                    q_rows.update(zip(parents, q, strict=True))
        return TreeBlock(tokens, q_rows, widths, t0, self.clock.now())


def score_tree(runner: ModelRunner, seq: torch.Tensor, n: int, plan: TreePlan, tokens: torch.Tensor) -> torch.Tensor:
    """The target's logits [1 + N, V] at the root (row 0) and at each node (row 1 + i), in one
    forward over the committed tokens not yet cached and the tree's N nodes, with the tree mask."""
    cached, tree = runner.length, plan.tree
    fresh = seq[cached:n]
    if not tree.n_nodes:
        return runner.feed(fresh)[0]
    c, size, device = fresh.shape[0], tree.n_nodes, seq.device
    mask = torch.zeros(c + size, n + size, dtype=torch.bool, device=device)
    mask[:, :cached] = True
    mask[:c, cached:n] = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    mask[c:, cached:n] = True
    mask[c:, n:] = plan.ancestors
    positions = torch.cat([torch.arange(cached, n, device=device), n - 1 + plan.depths])
    logits = runner.feed(torch.cat([fresh, tokens]), c + size, positions, mask)[0]
    return logits[c - 1 :]


class TreeRule:
    """Sequoia's node-by-node acceptance rule over a drafted tree (module docstring): called as
    ``rule(tree, tokens [N], q rows, target logits [1 + N, V], generator) -> (path, next_token)``,
    the accepted nodes from the root down and the token the target adds. Exact: the path and the
    token have the target's warped distribution. ``lossy = False``."""

    lossy = False
    name = "sequoia"

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling

    def __call__(self, tree: TokenTree, tokens: torch.Tensor, q_rows: dict, logits: torch.Tensor,
                 gen: torch.Generator | None) -> tuple[list[int], int]:
        drafted = tokens.tolist()
        if self.sampling.greedy:
            best = argmax(logits).tolist()
            path, node = [], -1
            while True:
                y = best[node + 1]
                child = next((c for c in tree.children[node] if drafted[c] == y), None)
                if child is None:
                    return path, y
                path.append(child)
                node = child
        path, node = [], -1
        while True:
            r_dist = warp(logits[node + 1], self.sampling)
            child = self._accept_child(tree.children[node], drafted, r_dist, q_rows.get(node), gen)
            if isinstance(child, torch.Tensor):  # all rejected (or a leaf): the final token from R
                return path, draw_token(child, gen)
            path.append(child)
            node = child

    @staticmethod
    def _accept_child(children: Sequence[int], drafted: list[int], r_dist: torch.Tensor, d_dist, gen):
        """Sequoia's Algorithm 1 over one node's children: the accepted child, or the residual R
        to sample from when none is accepted."""
        drawn = []
        for c in children:
            x = drafted[c]
            u = float(torch.rand((), generator=gen, device=r_dist.device))
            if u * float(d_dist[x]) < float(r_dist[x]):  # accept with min(1, R(x) / D(x))
                return c
            drawn.append(x)
            r_dist, d_dist = reject(r_dist, d_dist, drawn)
        return r_dist


def reject(r_dist: torch.Tensor, d_dist: torch.Tensor, drawn: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """After child ``drawn[-1]`` is rejected: ``R <- Norm[(R - D)+]`` with the current D, then the
    child leaves D, which is renormalised (uniform over the tokens not in ``drawn`` once it is empty):
    the next child's D is the distribution it was drawn from (:func:`gumbel_top_k`)."""
    r_dist = residual(r_dist, d_dist)
    d_dist = d_dist.clone()
    d_dist[drawn[-1]] = 0
    mass = float(d_dist.sum())
    if mass > 0:
        return r_dist, d_dist / mass
    d_dist = torch.ones_like(d_dist)
    d_dist[drawn] = 0
    return r_dist, d_dist / d_dist.sum()


def check_tree_model(model, role: str) -> None:
    """Tree attention passes a custom 4-D mask and position ids; refuse models that cannot take it."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in TREE_ATTENTION:
        raise ValueError(f"SequoiaDecoder: the {role} model uses attention {impl!r}, which does not take the custom "
                         f"4-D tree mask; load it with attn_implementation='sdpa' or 'eager'")


def tree_buckets(tree: TokenTree) -> dict[str, tuple[int, ...]]:
    """The forward widths of a tree's rounds once the prompt is cached, per model (the fast path's
    buckets: one compiled step per width): the target's 1 + nodes of the tree cut at every depth,
    the draft's 1, 2 and every level's count of nodes with children."""
    target = {1 + tree.truncated(depth).n_nodes for depth in range(tree.depth)}
    draft = {1, 2, *(sum(1 for v in level if tree.children[v]) for level in tree.levels)} - {0}
    return {"target": tuple(sorted(target)), "draft": tuple(sorted(draft))}


class SequoiaDecoder(FastPlanned):
    """Sequoia's tree speculative decoding of one prompt (batch 1); ``generate`` and its output as
    :class:`~specdecpp.SpeculativeDecoder`'s, the stats are :class:`SequoiaStats`.

    tree: a :class:`TokenTree`, a list of parent indices or a tree JSON file (``python -m
    infer.sequoia tree`` writes one). Lossless: greedy output equals the target's greedy decoding,
    sampled output has the target's warped distribution. ``profile``: as SpeculativeDecoder's.

    ``fast``: as SpeculativeDecoder's. The buckets are the tree's own widths, so each maps to one
    compiled step: the target's are 1 + the nodes of the tree cut at each depth (it scores the root
    and the nodes), the draft's 1, 2 (the root, after a round whose last accepted node was a leaf)
    and each level's nodes that have children (:func:`tree_buckets`)."""

    def __init__(self, draft, target, tree, sampling: SamplingConfig | None = None, profile: bool = False,
                 fast: str | None = None) -> None:
        self.tree = TokenTree.coerce(tree)
        self.device = check_pair_devices(draft, target)
        self.feature = feature_pair(draft, target)  # a FeatureDraft: its levels read their parents' states
        if self.feature and fast in GRAPH_BACKENDS:
            refuse_feature_draft(draft, f"SequoiaDecoder(fast={fast!r})", "CUDA graphs do not hand it the "
                                 "target's features; decode it with fast='compile', 'static' or None")
        for model, role in ((target, "target"),) if self.feature else ((draft, "draft"), (target, "target")):
            check_tree_model(model, role)
        static_models = (target,) if self.feature else (draft, target)  # a feature draft keeps its own runner
        self.fast = check_fast("SequoiaDecoder", fast, self.device, *static_models)
        self.buckets = tree_buckets(self.tree)
        self.runners = CallRunners(self.fast, static_models)
        self.draft, self.target, self.profile = draft, target, profile
        self.sampling = sampling or SamplingConfig()
        self.vocab = min(output_vocab_size(draft), output_vocab_size(target))
        self.rule = TreeRule(self.sampling)
        self._plans: dict[int, TreePlan] = {}

    def plan(self, max_depth: int) -> TreePlan:
        """The tree cut to ``max_depth`` below the root, planned once."""
        tree = self.tree.truncated(max_depth)
        if tree.n_nodes not in self._plans:
            self._plans[tree.n_nodes] = TreePlan.build(tree, self.device)
        return self._plans[tree.n_nodes]

    def fast_plan(self, prompt_len: int, max_new_tokens: int) -> tuple[int, list]:
        """As ``SpeculativeDecoder.fast_plan``: the widest round is the tree's."""
        tokens = prompt_len + max_new_tokens + self.tree.size + 1
        return tokens, [(self.draft, self.buckets["draft"]), (self.target, self.buckets["target"])]

    @decoding
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int = 128, generator: torch.Generator | None = None,
                 eos_token_id: int | Iterable[int] | None = None, return_caches: bool = False) -> GenerateOutput:
        gen, clock, marks, seq = start_generate(prompt_ids, max_new_tokens, eos_token_id, generator, self.device,
                                                self.profile, models=(self.draft, self.target))
        tokens, ((_, draft_buckets), (_, target_buckets)) = self.fast_plan(seq.prompt_len, max_new_tokens)
        draft_runners, target_runners = (
            fast_feature_runners(self.draft, self.target, self.runners, tokens, target_buckets) if self.feature
            else (self.runners(tokens, draft_buckets), self.runners(tokens, target_buckets)))
        draft = draft_runners(self.draft, self.vocab, False)
        target = target_runners(self.target, self.vocab, False)
        drafter = TreeDrafter(draft, self.sampling, marks)
        stats = SequoiaStats(tree_size=self.tree.size, tree_depth=self.tree.depth)
        t_start = clock.now()

        while not seq.finished:
            n = seq.n  # committed: seq.tokens[:n]; the root tokens[n - 1]
            # a feature draft before the target's first forward has nothing to read: no tree that round
            plan = self.plan(seq.room - 1 if draft.ready(n) else 0)
            block = drafter.grow(seq.tokens, n, plan, gen)
            logits = score_tree(target, seq.tokens, n, plan, block.tokens)
            path, token = self.rule(plan.tree, block.tokens, block.q, logits, gen)
            t_verified = marks.now()
            seq.tokens[n : n + len(path)] = block.tokens[path]
            kept = seq.commit(len(path), token)
            target.compact([*range(n), *(n + i for i in path)])
            if plan.tree.n_nodes:
                draft.compact([*range(n), *(n + plan.slot[i] for i in path if i in plan.slot)])
            target.rollback(seq.n - 1)
            draft.rollback(seq.n - 1)
            size = plan.tree.n_nodes
            stats.add_round(plan.n_draft_forwards, size, len(path), size + 1 - kept,
                            block.t1 - block.t0, t_verified - block.t1)
            stats.n_draft_tokens += sum(block.widths)
            stats.draft_widths += block.widths
            stats.accepted_ranks.append([plan.tree.ranks[i] for i in path])

        if not marks.exact:
            stats.draft_time_s = stats.target_time_s = float("nan")
        return finish(stats, seq, clock.now() - t_start, draft, target, return_caches)

    def settings(self) -> dict:
        return {"tree_size": self.tree.size, "tree_depth": self.tree.depth, "parents": list(self.tree.parents)}
