"""Sequoia's parts on their own (the decoder's exactness tests are in test_exactness.py's registry):
trees as data, draws without replacement, the node rule by enumeration, the tree forward against
sequential scoring, EOS and the length limit, model checks, and the DP against brute force."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math

import pytest
import torch

from specdecpp import SamplingConfig, SequoiaDecoder, TokenTree
from specdecpp.analysis.costmodel import Costs
from specdecpp.analysis.tree_search import TreeDP, choose_tree, draft_widths
from specdecpp.core.timing import Clock
from specdecpp.decoders.sequoia import TreeDrafter, TreePlan, gumbel_top_k, reject, score_tree
from specdecpp.models.runner import ModelRunner
from tests.helpers.stats import chi_square_pvalue
from tests.helpers.tiny import noisy_copy, tiny_lm

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


# -- trees as data ------------------------------------------------------------------------------

def test_parent_list_shape():
    tree = TokenTree([-1, -1, 0, 0, 1])
    assert (tree.n_nodes, tree.size, tree.depth, tree.branching) == (5, 6, 3, 2)
    assert tree.children == {-1: (0, 1), 0: (2, 3), 1: (4,), 2: (), 3: (), 4: ()}
    assert tree.depths == (1, 1, 2, 2, 2) and tree.levels == (range(0, 2), range(2, 5))
    assert tree.ranks == (1, 2, 1, 2, 1) and tree.path(4) == [1, 4]
    assert tree.ancestor_mask().tolist()[4] == [False, True, False, False, True]
    assert TokenTree.chain(4).parents == (-1, 0, 1, 2) and TokenTree.chain(4).depth == 5
    assert TokenTree.star(3).parents == (-1, -1, -1) and TokenTree([]).size == 1
    assert TokenTree.from_branching([[2], [2, 1]]) == tree
    assert tree.truncated(1) == TokenTree.star(2) and tree.truncated(5) is tree and tree.truncated(0).n_nodes == 0
    # F(T) = 1 + p1 + p2 + p1 p1 + p1 p2 + p2 p1
    assert tree.expected_tokens([0.5, 0.2]) == pytest.approx(1 + 0.7 + 0.25 + 0.1 + 0.1)


def test_tree_json_round_trip(tmp_path):
    tree = TokenTree([-1, -1, 0, 0, 1], {"chosen_by": "test"})
    path = tree.save(tmp_path / "t" / "tree.json")
    back = TokenTree.load(path)
    assert back == tree and back.meta["chosen_by"] == "test" and json.loads(path.read_text())["size"] == 6
    plain = tmp_path / "plain.json"
    plain.write_text("[-1, 0, 1]")
    assert TokenTree.load(plain) == TokenTree.chain(3) and TokenTree.coerce(str(plain)) == TokenTree.chain(3)


@pytest.mark.parametrize("parents,match", [
    ("-1,0", "list of parent indices"), ([-1, 1], "parent of node 1 is 1"), ([0], "parent of node 0 is 0"),
    ([-1, -1, 0, -1], "breadth-first order"), ([-1, 0.5], "must be an integer"), ([-1, True], "must be an integer"),
])
def test_malformed_tree_is_named(parents, match):
    with pytest.raises(ValueError, match=match):
        TokenTree(parents)


def test_malformed_tree_file_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    for text, match in (("{", "not valid JSON"), ('{"x": 1}', "'parents'"), ('{"parents": [-1, 2]}', "node 1 is 2"),
                        ('{"parents": [-1], "size": 5}', "says size 5"),
                        ('{"schema": "other", "parents": []}', "schema")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=match) as info:
            TokenTree.load(bad)
        assert "bad.json" in str(info.value)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        TokenTree.load(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="tree must be"):
        TokenTree.coerce(3)


# -- draws without replacement and the node rule --------------------------------------------------

def _sequential_order_prob(q: list[float], order: tuple[int, ...]) -> float:
    """P(first draws = order) drawing without replacement from q, uniform over the rest once q's
    support is used up (the draws gumbel_top_k makes)."""
    prob, left, drawn = 1.0, list(q), set()
    for x in order:
        mass = sum(left)
        if mass > 0:
            prob *= left[x] / mass
        else:
            prob *= 1.0 / (len(q) - len(drawn))
        left[x] = 0.0
        drawn.add(x)
    return prob


@pytest.mark.parametrize("q", [[0.5, 0.3, 0.15, 0.05], [0.7, 0.3, 0.0, 0.0, 0.0]], ids=["full", "support2"])
def test_gumbel_top_k_draws_without_replacement_in_order(q):
    k = 3
    qt = torch.tensor([q] * 4000)
    draws = gumbel_top_k(qt, k, torch.Generator().manual_seed(0))
    assert all(len(set(row)) == k for row in draws.tolist())
    expected = {o: _sequential_order_prob(q, o) for o in itertools.permutations(range(len(q)), k)}
    expected = {o: p for o, p in expected.items() if p > 0}
    assert chi_square_pvalue([tuple(r) for r in draws.tolist()], expected) > 1e-4


def _node_output(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """The exact distribution of one node's outcome (the accepted child's token, or the token
    sampled from R) with k children drawn as gumbel_top_k draws them, by enumeration over draws,
    with the decoder's own rejection step :func:`reject`."""
    out = torch.zeros_like(p, dtype=torch.float64)

    def walk(r_dist, d_dist, drawn, weight):
        if len(drawn) == k:
            out.add_(weight * r_dist.double())
            return
        for x in range(p.shape[0]):
            if x in drawn or float(d_dist[x]) == 0:
                continue
            w = weight * float(d_dist[x])
            accept = min(1.0, float(r_dist[x]) / float(d_dist[x]))
            out[x] += w * accept
            if accept < 1:
                walk(*reject(r_dist, d_dist, [*drawn, x]), [*drawn, x], w * (1 - accept))

    walk(p.clone(), q.clone(), [], 1.0)
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_node_rule_keeps_the_target_distribution(k):
    """Sequoia's node rule over k children drawn without replacement gives exactly p (cover and
    uniform fallback included: q's support is 2 of 5 tokens)."""
    g = torch.Generator().manual_seed(k)
    for trial in range(4):
        p = torch.rand(5, generator=g) ** 3
        q = torch.rand(5, generator=g) ** 2
        if trial % 2:
            q[torch.tensor([1, 3, 4])] = 0
            p[0] = 0
        p, q = p / p.sum(), q / q.sum()
        torch.testing.assert_close(_node_output(p, q, k), p.double(), atol=1e-6, rtol=0)


# -- the tree forward -------------------------------------------------------------------------

def _qwen2(vocab=32, seed=3):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.4, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).float().eval().requires_grad_(False)


MODELS = {"llama": lambda: tiny_lm(32, 32, 2, seed=5, scale=0.4), "qwen2": _qwen2}
TREE = [-1, -1, -1, 0, 0, 1, 3, 3, 5, 6]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(MODELS))
def test_tree_forward_equals_sequential_path_scoring(arch, device):
    """The target's tree forward gives, at every node, the logits of scoring the prefix and the
    node's root-to-node path causally; the draft's level-by-level forwards draw (greedy) each
    node's children from the logits of its own path."""
    model = MODELS[arch]().to(device)
    tree = TokenTree(TREE)
    plan = TreePlan.build(tree, device)
    seq = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6], device=device)
    n = 6
    tokens = torch.randint(0, 32, (tree.n_nodes,), generator=torch.Generator().manual_seed(0)).to(device)
    runner = ModelRunner(model, 32, want_hidden=False)
    with torch.no_grad():
        runner.feed(seq[:3])  # a cache that lags by two committed tokens
        logits = score_tree(runner, seq, n, plan, tokens)
        assert runner.length == n + tree.n_nodes and logits.shape == (tree.n_nodes + 1, 32)
        for node in [-1, *range(tree.n_nodes)]:
            path = seq[:n] if node < 0 else torch.cat([seq[:n], tokens[tree.path(node)]])
            ref = model(path[None]).logits[0, -1]
            torch.testing.assert_close(logits[node + 1], ref, atol=1e-4, rtol=1e-4)
        drafter = TreeDrafter(ModelRunner(model, 32, want_hidden=False), SamplingConfig(temperature=0), Clock(device))
        block = drafter.grow(seq, n, plan, None)
        for node in [-1, *range(tree.n_nodes)]:
            kids = tree.children[node]
            if kids:
                path = seq[:n] if node < 0 else torch.cat([seq[:n], block.tokens[tree.path(node)]])
                ref = model(path[None]).logits[0, -1].topk(len(kids)).indices
                assert block.tokens[list(kids)].tolist() == ref.tolist(), node
        # the accepted path's entries moved next to the prefix equal a fresh prefill of it
        path = tree.path(8)  # nodes 1, 5, 8
        runner.compact([*range(n), *(n + i for i in path)])
        fresh = ModelRunner(model, 32, want_hidden=False)
        fresh.feed(torch.cat([seq[:n], tokens[path]]))
        for mine, ref in zip(runner.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-4)


def test_qwen2_tree_decoding_equals_target_greedy():
    target = _qwen2()
    draft = noisy_copy(target, 0.3, seed=4)
    decoder = SequoiaDecoder(draft, target, TREE, SamplingConfig(temperature=0))
    for prompt in ([1, 2, 3], [7]):
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=17, do_sample=False)
        assert decoder.generate(torch.tensor([prompt]), 17).tokens.tolist() == ref.tolist()


def test_compact_checks_positions():
    runner = ModelRunner(tiny_lm(8, 16, 1), 8, want_hidden=False)
    with torch.no_grad():
        runner.feed(torch.arange(5))
    for keep in ([0, 2, 2], [0, 9], [3, 1]):
        with pytest.raises(ValueError, match="strictly increasing"):
            runner.compact(keep)
    runner.compact([0, 1, 2])
    assert runner.length == 3


# -- a round's ends: EOS inside the path, the length limit ------------------------------------

@pytest.fixture(scope="module")
def same_pair():
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    return copy.deepcopy(target), target


def test_eos_inside_an_accepted_path(same_pair):
    draft, target = same_pair  # the draft is the target: a chain is accepted whole
    prompt = torch.tensor([[1, 2, 3]])
    ref = target.generate(prompt, max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    eos = ref[2]
    assert eos not in ref[:2]
    out = SequoiaDecoder(draft, target, TokenTree.chain(6), SamplingConfig(temperature=0)).generate(
        prompt, 20, eos_token_id=eos, return_caches=True)
    s = out.stats
    assert out.tokens[0, 3:].tolist() == ref[:3] and s.n_generated == 3
    assert s.accept_lengths == [6] and s.n_discarded == 6 + 1 - 3  # the path ran past EOS: cut
    assert out.caches["target"].get_seq_length() == 3 + 3 - 1


def test_length_limit_cuts_the_tree(same_pair):
    draft, target = same_pair
    prompt = torch.tensor([[4, 5]])
    ref = target.generate(prompt, max_new_tokens=10, do_sample=False)
    out = SequoiaDecoder(draft, target, TokenTree.from_branching([[2], [1, 1], [1, 0]]),
                         SamplingConfig(temperature=0)).generate(prompt, 10)
    s = out.stats
    assert out.tokens.tolist() == ref.tolist() and s.n_generated == 10
    assert s.candidate_lengths == [5, 5, 2] and s.accept_lengths == [3, 3, 1]  # room 2: the root's children only
    assert s.accepted_ranks == [[1, 1, 1], [1, 1, 1], [1]] and s.tokens_per_target_call == 10 / 3
    assert s.n_draft_calls == 3 + 3 + 1 and s.tree_size == 6 and s.tree_depth == 4


def test_tree_model_checks(same_pair):
    draft, target = same_pair
    other = copy.deepcopy(target)
    other.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="target model uses attention 'flash_attention_2'"):
        SequoiaDecoder(draft, other, [-1])
    with pytest.raises(ValueError, match="parent of node 0"):
        SequoiaDecoder(draft, target, [0])


# -- the tree choice --------------------------------------------------------------------------

@functools.cache
def _all_trees(m: int, depth: int, width: int) -> tuple:
    """Every ordered tree of m nodes (root included), at most ``depth`` levels and ``width``
    children per node, as nested tuples of child subtrees."""
    if m == 1:
        return ((),)
    if depth == 1:
        return ()
    out = []
    for parts in range(1, min(width, m - 1) + 1):
        for cuts in itertools.combinations(range(1, m - 1), parts - 1):
            sizes = [b - a for a, b in zip((0, *cuts), (*cuts, m - 1), strict=True)]
            for kids in itertools.product(*(_all_trees(s, depth - 1, width) for s in sizes)):
                out.append(kids)
    return tuple(out)


def _score(tree, p) -> float:
    return 1.0 + sum(p[i] * _score(kid, p) for i, kid in enumerate(tree))


def _parents(tree) -> list[int]:
    parents, queue = [], [(-1, tree)]
    while queue:
        node, kids = queue.pop(0)
        for kid in kids:
            parents.append(node)
            queue.append((len(parents) - 1, kid))
    return parents


@pytest.mark.parametrize("p", [[0.6, 0.2, 0.1], [0.3, 0.35, 0.05], [0.9], [0.45, 0.3, 0.1, 0.05]])
def test_dp_equals_brute_force(p):
    dp = TreeDP(p, 8, 5)
    for n, d in itertools.product(range(1, 9), range(1, 6)):
        trees = _all_trees(n, d, len(p))
        if not trees:
            assert dp.value(n, d) == -math.inf
            continue
        best = max(_score(t, p) for t in trees)
        assert dp.value(n, d) == pytest.approx(best, abs=1e-12), (n, d)
        tree = dp.tree(n, d)
        assert tree.size == n and tree.depth <= d and tree.branching <= len(p)
        assert tree.expected_tokens(p) == pytest.approx(best, abs=1e-12)
    some = _all_trees(4, 4, len(p))[-1]
    assert TokenTree(_parents(some)).expected_tokens(p) == pytest.approx(_score(some, p))


def test_dp_bad_input_is_named():
    for p in ([0.7, 0.5], [], [-0.1], [float("nan")]):
        with pytest.raises(ValueError, match="acceptance vector"):
            TreeDP(p, 4, 3)
    with pytest.raises(ValueError, match="max_size"):
        TreeDP([0.5], 0, 3)
    with pytest.raises(ValueError, match="outside the table"):
        TreeDP([0.5], 4, 3).value(5, 2)
    with pytest.raises(ValueError, match="no tree of size 4"):
        TreeDP([0.5], 4, 3).tree(4, 2)  # one child per node, two levels: size 2 at most


def test_choice_follows_the_cost_curve():
    """A flat verification cost (a GPU at batch 1) buys a big tree; a steep one (a CPU) a small one."""
    p = [0.55, 0.15, 0.07, 0.04, 0.02, 0.01]
    widths = [1, 2, 4, 8, 16, 32]
    draft = {n: 0.002 * (1 + 0.02 * n) for n in widths}
    flat = Costs(0.002, 0.05, {n: 0.05 * (1 + 0.003 * n) for n in widths}, draft_by_width=draft)
    steep = Costs(0.002, 0.05, {n: 0.05 * (1 + 0.25 * (n - 1)) for n in widths}, draft_by_width=draft)
    big, table_flat = choose_tree(p, flat, max_depth=8)
    small, table_steep = choose_tree(p, steep, max_depth=8)
    assert big.size == 32 and small.size <= 4
    for table in (table_flat, table_steep):
        assert table == sorted(table, key=lambda c: -c.speedup) and {c.size for c in table} == set(widths)
        base = next(c for c in table if c.size == 1)
        assert base.speedup == pytest.approx(1.0) and base.draft_widths == ()
    assert big.meta["predicted_speedup"] == table_flat[0].speedup
    assert draft_widths(TokenTree([-1, -1, 0, 0, 1, 2])) == (1, 2, 1)
    with pytest.raises(ValueError, match="measured up to width 32"):
        choose_tree(p, flat, sizes=[64])
    with pytest.raises(ValueError, match="draft_by_width"):
        choose_tree(p, Costs(0.002, 0.05, {1: 0.05, 2: 0.06}))
