"""The exactness tests of the feature draft (specdecpp.models.feature_draft, EAGLE-3's form) under the
chain decoder with every stop policy, on the CPU and (marker ``gpu``) on CUDA: greedy output equals
the target's own, sampled output follows the target's exact warped distribution (T=1, top-k with EOS,
top-p), the same seed gives the same output; the features the round core hands the draft equal a
fresh teacher-forced target forward over the kept prefix; the decoders that cannot feed a feature
draft refuse it, naming it.

A feature pair's first round drafts nothing (the target's prefill gives the first token and the
features the draft reads), so the adaptive policies' stop is checked to vary in the first round that
drafts."""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from test_exactness import DECODERS, InBatch  # the plain registry's batch entries and its view of one row

from specdecpp import (
    SVIP,
    AcceptanceHead,
    FixedK,
    NextTokenHead,
    PEARLDecoder,
    SamplingConfig,
    SequoiaDecoder,
    SpecDecPP,
    SpeculativeDecoder,
    TargetOnly,
)
from specdecpp.decoders.cascade import Cascade
from specdecpp.fast import features as features_module
from specdecpp.fast.features import StaticBatchFeatureTargetRunner
from specdecpp.fast.step import feature_model_steps
from specdecpp.models.feature_draft import FeatureDraft
from specdecpp.models.feature_runner import RowStores
from tests.helpers.stats import chi_square_pvalue, exact_distribution, sampled_grid
from tests.helpers.tiny import tiny_lm

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

FEATURE_DECODERS = {
    "chain-target_only": lambda d, t, s, h, **kw: SpeculativeDecoder(d, t, TargetOnly(), s, **kw),
    "chain-fixed_k3": lambda d, t, s, h, **kw: SpeculativeDecoder(d, t, FixedK(3), s, **kw),
    "chain-svip": lambda d, t, s, h, **kw: SpeculativeDecoder(d, t, SVIP(threshold=0.33, max_candidates=4), s, **kw),
    "chain-paper_head": lambda d, t, s, h, **kw: SpeculativeDecoder(
        d, t, SpecDecPP(h["paper"], 0.5, max_candidates=4), s, **kw),
    "chain-lag_free_head": lambda d, t, s, h, **kw: SpeculativeDecoder(
        d, t, SpecDecPP(h["next"], 0.5, max_candidates=4), s, **kw),
    # token trees: each level's nodes read their parents' states (a chain of three, and two levels)
    "sequoia-chain3": lambda d, t, s, h, **kw: SequoiaDecoder(d, t, [-1, 0, 1], s, **kw),
    "sequoia-two_level": lambda d, t, s, h, **kw: SequoiaDecoder(d, t, [-1, -1, 0, 0, 1], s, **kw),
}
# The fast path (specdecpp.fast.features): every decoder again with the target on the static KV cache
# (``-fast_static``) and, slow, with its forwards compiled (``-fast_compile``); the draft keeps its own
# runner. Their CPU cases repeat the eager chain's decodes seed for seed
# (test_fast_sampled_output_equals_eager), their CUDA cases pass the chi-square.
for _name in list(FEATURE_DECODERS):
    for _fast in ("static", "compile"):
        FEATURE_DECODERS[f"{_name}-fast_{_fast}"] = functools.partial(FEATURE_DECODERS[_name], fast=_fast)
# Per-row batches (specdecpp.decoders.batch_features; eager): the prompt under test among batch-mates
# (test_exactness.InBatch), all rows at once, drafting to the longest row's stop (fill), or joining a
# running batch (queued). A batch's rows join prefilled, so their first round drafts.
FEATURE_DECODERS.update({name: DECODERS[name] for name in ("batch-fixed_k3", "batch-svip", "batch-paper_head",
                                                             "batch_queued-lag_free_head")})
FEATURE_DECODERS["batch-target_only"] = lambda d, t, s, h, **kw: InBatch(
    SpeculativeDecoder(d, t, TargetOnly(), s, **kw))
FEATURE_DECODERS["batch_fill-lag_free_head"] = lambda d, t, s, h, **kw: InBatch(
    SpeculativeDecoder(d, t, SpecDecPP(h["next"], 0.5, max_candidates=4), s, **kw), fill=True)
# (batch-paper_head is left out: the paper head is centred on the chain's first drafting round, and in a
# batch's rounds it stops at 2 candidates in nearly every one; batch-svip and the queued lag-free head
# check that a batch row's adaptive stop varies)
# Per-row batches on the fast path (specdecpp.fast.features.StaticBatchFeatureTargetRunner: the target on
# the static cache of per-row lengths, the draft eager): each batch again with ``-fast_static``; compiled
# batches are checked by test_compiled_feature_batches_compile_each_bucket_once (a (batch, width) bucket
# compiles for half a minute on 2 cores, and every batch here would compile a dozen).
for _name in [n for n in FEATURE_DECODERS if n.startswith("batch")]:
    FEATURE_DECODERS[f"{_name}-fast_static"] = functools.partial(FEATURE_DECODERS[_name], fast="static")
ADAPTIVE = ("chain-svip", "chain-paper_head", "chain-lag_free_head", "batch-svip", "batch_queued-lag_free_head")

PROMPT = [0, 1]  # the chi-square prompt; the heads are centred so their stop varies after it


def _feature_draft(target, seed: int) -> FeatureDraft:
    """An untrained feature draft whose fc and layer are scaled down, so its q stays near the target's
    own next-token distribution (the copied lm_head over a small update of the target's features)
    and candidates are often accepted."""
    draft = FeatureDraft.init_from(target, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad and p.dim() == 2:
                p.mul_(0.5)
    return draft.eval()


def _centred_heads(draft: FeatureDraft, target, hidden: int) -> dict:
    """A paper head and a lag-free head over the feature draft's state, each centred on the first
    drafting round after :data:`PROMPT` (the draft's states after ``PROMPT + [a]``), so that whether
    a round stops depends on the tokens drawn."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        paper, lag_free = AcceptanceHead(hidden, 1), NextTokenHead(hidden, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        states, logits = [], []
        for a in range(5):
            ids = torch.tensor([PROMPT + [a]])
            feats = draft.fuse(target(ids, output_hidden_states=True).hidden_states)
            out = draft(ids[:, 1:], features=feats[:, :-1])
            states.append(out.hidden[0, -1])
            logits.append(out.logits[0, -1])
        states = torch.stack(states)
        paper.out.weight.normal_(0, 1.0, generator=g)
        paper.out.bias.sub_(paper(states).median() + 0.1)
        lag_free.out.weight.normal_(0, 1.0, generator=g)
        lag_free.attach(draft)
        scores = torch.stack([lag_free.score(states[0], logits[0], torch.tensor(y)) for y in range(5)])
        lag_free.out.bias.sub_(scores.median() + 0.05)
    return {"paper": paper, "next": lag_free}


@pytest.fixture(scope="module")
def feature_pair6():
    target = tiny_lm(5, 16, 4, seed=21, scale=0.8, heads=2)
    draft = _feature_draft(target, 22)
    return draft, target, _centred_heads(draft, target, 16)


@pytest.fixture(scope="module")
def feature_pair32():
    target = tiny_lm(32, 32, 4, seed=5, scale=0.4)
    draft = _feature_draft(target, 6)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        heads = {"paper": AcceptanceHead(32, 2), "next": NextTokenHead(32, 1)}
    return draft, target, heads


def on(device: str, pair):
    if device == "cpu":
        return pair
    draft, target, heads = pair
    return (copy.deepcopy(draft).to(device), copy.deepcopy(target).to(device),
            {k: copy.deepcopy(h).to(device) for k, h in heads.items()})


def compiled(name: str) -> bool:
    return name.endswith("-fast_compile")


def cases() -> list:
    return [pytest.param(n, d, id=f"{n}-{d}",
                         marks=[pytest.mark.gpu] * (d == "cuda") + [pytest.mark.slow] * compiled(n))
            for n in FEATURE_DECODERS for d in ("cpu", "cuda")]


@pytest.mark.parametrize("name,device", cases())
def test_greedy_equals_target_greedy(feature_pair32, name, device):
    draft, target, heads = on(device, feature_pair32)
    decoder = FEATURE_DECODERS[name](draft, target, SamplingConfig(temperature=0), heads)
    cpu_target = feature_pair32[1]
    accepted = 0
    for prompt, n in itertools.product([[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]], (1, 6, 21)):
        ref = cpu_target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        out = decoder.generate(torch.tensor([prompt], device=device), max_new_tokens=n)
        assert out.tokens.cpu().tolist() == ref.tolist(), (name, prompt, n)
        assert out.stats.n_generated == n
        if "target_only" in name:
            assert set(out.stats.candidate_lengths) == {0}
        elif name.startswith("batch"):  # the row joined prefilled: its first round drafts (a one-token prompt's waits)
            assert (out.stats.candidate_lengths[0] == 0) == (len(prompt) == 1 or n == 1), out.stats.candidate_lengths
        else:
            assert out.stats.candidate_lengths[0] == 0  # the first round: the target's prefill alone
        accepted += sum(out.stats.accept_lengths)
    if "target_only" not in name:
        assert accepted > 0  # the draft's proposals were kept, not only the target's tokens


SAMPLINGS = [
    pytest.param(SamplingConfig(temperature=1.0), None, id="T1"),
    pytest.param(SamplingConfig(temperature=0.8, top_k=3), 2, id="T0.8-top3-eos2"),  # EOS = token 2
    pytest.param(SamplingConfig(temperature=1.0, top_p=0.99), None, id="T1-top_p0.99"),
]


# fixed K under each sampling, each adaptive policy and target-only under one (a case is 1,200 decodes,
# about 50 s on one CPU core); make test runs three of them
GRID = {"chain-fixed_k3-T1", "chain-fixed_k3-T0.8-top3-eos2", "chain-fixed_k3-T1-top_p0.99", "chain-svip-T1",
        "chain-paper_head-T0.8-top3-eos2", "chain-lag_free_head-T1-top_p0.99", "chain-target_only-T1",
        "sequoia-two_level-T1", "sequoia-chain3-T0.8-top3-eos2", "sequoia-two_level-T1-top_p0.99",
        "batch-fixed_k3-T1-top_p0.99", "batch-svip-T1", "batch-paper_head-T0.8-top3-eos2",
        "batch_fill-lag_free_head-T1", "batch_queued-lag_free_head-T0.8-top3-eos2", "batch-target_only-T1"}


def chi_square_case(case_id: str) -> bool:
    """The grid's cases: :data:`GRID`'s, eager on either device, and on CUDA its fast variants too
    (on the CPU those repeat the eager decodes exactly: test_fast_sampled_output_equals_eager)."""
    device = case_id.rsplit("-", 1)[1]
    name, _, rest = case_id.removesuffix(f"-{device}").partition("-fast_")
    if rest:  # "static-T1" -> name + "-T1"
        fast, _, sampling = rest.partition("-")
        return device == "cuda" and f"{name}-{sampling}" in GRID
    return name in GRID


@pytest.mark.parametrize("name,sampling,eos,device", [
    case for case in sampled_grid([pytest.param(n, id=n) for n in FEATURE_DECODERS], SAMPLINGS, DEVICES,
                                  fast={"chain-fixed_k3-T1", "chain-paper_head-T0.8-top3-eos2",
                                        "chain-lag_free_head-T1-top_p0.99", "sequoia-two_level-T1",
                                        "batch_queued-lag_free_head-T0.8-top3-eos2"})
    if chi_square_case(case.id)])
def test_sampled_output_has_target_distribution(feature_pair6, name, sampling, eos, device):
    """The first 3 generated tokens follow the target's exact warped distribution. The chain
    generates 4: the first round gives one token, the second drafts up to 3 (adaptive policies: a
    stop that varies, checked)."""
    draft, target, heads = on(device, feature_pair6)
    expected = exact_distribution(feature_pair6[1], PROMPT, 3, sampling, eos)
    decoder = FEATURE_DECODERS[name](draft, target, sampling, heads)
    if isinstance(decoder, InBatch):  # rows of batches (its first round drafts), not 1,200 calls
        outs, drafting_round = decoder.sample(PROMPT, 1200, 1234, eos, 4, device), 0
    else:
        g = torch.Generator().manual_seed(1234)
        outs = [decoder.generate(torch.tensor([PROMPT], device=device), generator=g, eos_token_id=eos,
                                 max_new_tokens=4) for _ in range(1200)]
        drafting_round = 1
    seqs, second_k, accepted = [], set(), 0
    by_cap: dict[int, set[int]] = {}  # a batch row's candidate lengths by the round's cap (4 or the room left)
    for out in outs:
        seqs.append(tuple(out.tokens[0, len(PROMPT) : len(PROMPT) + 3].tolist()))
        if len(out.stats.candidate_lengths) > drafting_round:
            second_k.add(out.stats.candidate_lengths[drafting_round])
        accepted += sum(out.stats.accept_lengths)
        generated = 0
        for k, n_acc in zip(out.stats.candidate_lengths, out.stats.accept_lengths, strict=True):
            by_cap.setdefault(min(4, 4 - generated - 1), set()).add(k)
            generated += n_acc + 1
    if drafting_round == 0:  # a batch's first round is the same for every row (it reads the prompt's features
        # only): the stop varies where rounds of one cap drafted different lengths
        second_k = max(by_cap.values(), key=len)
    assert chi_square_pvalue(seqs, expected) > 1e-4, name
    if "target_only" not in name:
        assert accepted > 100  # the acceptance path is exercised, not only resampling
    if name.split("-fast_")[0] in ADAPTIVE:
        assert len(second_k) >= 2, second_k  # the adaptive stop really varies


SAMPLING_BY_ID = {p.id: tuple(p.values) for p in SAMPLINGS}


def _decodes(decoder, sampling_id: str, n: int = 240) -> list:
    """``n`` decodes of :data:`PROMPT` (4 new tokens) from one seed: each one's tokens and every
    round's candidate and accepted lengths."""
    eos = SAMPLING_BY_ID[sampling_id][1]
    g = torch.Generator().manual_seed(1234)
    outs = [decoder.generate(torch.tensor([PROMPT]), generator=g, eos_token_id=eos, max_new_tokens=4)
            for _ in range(n)]
    return [(o.tokens.tolist(), list(o.stats.candidate_lengths), list(o.stats.accept_lengths)) for o in outs]


FAST_EQUALS_EAGER_IN_MAKE_TEST = ("chain-lag_free_head-fast_static-T1", "chain-svip-fast_static-T0.8-top3-eos2",
                                  "sequoia-two_level-fast_static-T1",
                                  "batch_queued-lag_free_head-fast_static-T0.8-top3-eos2")
# a batch's 240 decodes take 15-30 s: three batches, each under one sampling (an adaptive stop alone, with fill,
# queued); fixed K's, target-only's and the paper head's static batches are checked by greedy and same seed
BATCH_FAST_EQUALS_EAGER = {"batch_queued-lag_free_head-fast_static-T0.8-top3-eos2", "batch-svip-fast_static-T1",
                           "batch_fill-lag_free_head-fast_static-T1-top_p0.99"}


@pytest.mark.parametrize("name,sampling_id", [
    pytest.param(n, s.id, id=f"{n}-{s.id}",
                 marks=[pytest.mark.slow] * (compiled(n) or f"{n}-{s.id}" not in FAST_EQUALS_EAGER_IN_MAKE_TEST))
    for n in FEATURE_DECODERS if "-fast_" in n for s in SAMPLINGS
    if not n.startswith("batch") or f"{n}-{s.id}" in BATCH_FAST_EQUALS_EAGER])
def test_fast_sampled_output_equals_eager(feature_pair6, name, sampling_id):
    """On the CPU the fast path's target forwards (static cache, compiled steps) change how a
    forward is computed, not what a round does with it: 240 seeded decodes equal the eager chain's,
    tokens and every round's candidate and accepted lengths, and the eager chain passes the
    chi-square above; accepts and (adaptive policies) varying stops happen in them."""
    draft, target, heads = feature_pair6
    sampling = SAMPLING_BY_ID[sampling_id][0]
    base = name.split("-fast_")[0]
    want = _decodes(FEATURE_DECODERS[base](draft, target, sampling, heads), sampling_id)
    got = _decodes(FEATURE_DECODERS[name](draft, target, sampling, heads), sampling_id)
    diverged = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not diverged, f"{name}: {len(diverged)} of 240 decodes differ from {base}'s, the first: " \
                         f"{got[diverged[0]]} against {want[diverged[0]]}"
    if "target_only" not in base:
        assert sum(sum(acc) for _, _, acc in got) > 10  # candidates were accepted, not only resampled
    if base in ADAPTIVE:
        assert len({k for _, ks, _ in got for k in ks[1:]}) >= 2  # the adaptive stop varies


@pytest.mark.parametrize("name,device", cases())
def test_same_seed_same_output(feature_pair32, name, device):
    draft, target, heads = on(device, feature_pair32)
    decoder = FEATURE_DECODERS[name](draft, target, SamplingConfig(temperature=1.0, top_k=10), heads)

    def run(seed):
        out = decoder.generate(torch.tensor([[1, 2]], device=device), 24, generator=torch.Generator().manual_seed(seed))
        return out.tokens.tolist(), out.stats.accept_lengths, out.stats.candidate_lengths

    first = run(0)
    assert run(0) == first and run(1) != first


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)],
                         ids=["greedy", "T1"])
@pytest.mark.parametrize("name", ["chain-fixed_k3", "chain-svip", "chain-lag_free_head", "sequoia-two_level",
                                  "chain-svip-fast_static", "sequoia-two_level-fast_static",
                                  pytest.param("chain-fixed_k3-fast_compile", marks=pytest.mark.slow)])
def test_features_handed_to_the_draft_equal_a_fresh_target_forward(feature_pair32, monkeypatch, name, sampling,
                                                                   device):
    """After many rounds of accepts and rejections (a tree's: after its compaction), the target's
    features the round core keeps equal a fresh teacher-forced target forward over the kept prefix,
    and the draft's cache equals a fresh draft forward over those features and tokens (each entry j:
    feature g_j, token x_{j+1})."""
    draft, target, heads = on(device, feature_pair32)
    made = []
    real = features_module.feature_runners

    def recording(d, t, *args):
        draft_runners, target_runners = real(d, t, *args)
        return (lambda *a: made.append(draft_runners(*a)) or made[-1],
                lambda *a: made.append(target_runners(*a)) or made[-1])

    monkeypatch.setattr(features_module, "feature_runners", recording)
    decoder = FEATURE_DECODERS[name](draft, target, sampling, heads)
    out = decoder.generate(torch.tensor([[3, 1, 4]], device=device), 40, generator=torch.Generator().manual_seed(3))
    tokens, s = out.tokens[0], out.stats
    assert len(s.accept_lengths) > 5 and 0 < sum(s.accept_lengths) and min(s.accept_lengths[1:]) < max(
        s.candidate_lengths)  # accepts and rejections happened
    draft_runner, target_runner = made
    store = target_runner.store
    assert store.length == target_runner.length == tokens.shape[0] - 1  # every committed token but the newest
    with torch.no_grad():
        fresh = draft.fuse(target(tokens[None, : store.length], output_hidden_states=True).hidden_states)[0]
        # to float32 rounding: the rounds' forwards are 1-5 tokens wide (padded to 4 on a CPU), the fresh one 40
        torch.testing.assert_close(store.rows[: store.length], fresh, atol=1e-3, rtol=2e-3)
        entries = draft_runner.cache.length
        assert entries == draft_runner.from_target and 0 < entries <= store.length
        cache = draft.new_cache()
        draft(tokens[None, 1 : entries + 1], features=fresh[None, :entries], cache=cache)
        for mine, ref in zip(draft_runner.cache.keys + draft_runner.cache.values, cache.keys + cache.values,
                             strict=True):
            torch.testing.assert_close(mine[:, :, :entries], ref[:, :, :entries], atol=1e-3, rtol=2e-3)


def test_decoders_that_cannot_feed_a_feature_draft_refuse_it(feature_pair32):
    draft, target, _ = feature_pair32
    with pytest.raises(ValueError, match=r"PEARLDecoder does not take a feature draft.*aux layers"):
        PEARLDecoder(draft, target, 2)
    with pytest.raises(ValueError, match=r"SequoiaDecoder\(fast='graphs'\) does not take a feature draft"):
        SequoiaDecoder(draft, target, [-1, 0, 1], fast="graphs")
    with pytest.raises(ValueError, match=r"fast='graphs'.*does not take a feature draft.*CUDA graphs"):
        SpeculativeDecoder(draft, target, FixedK(2), fast="graphs")
    with pytest.raises(ValueError, match=r"a cascade does not take a feature draft"):
        SpeculativeDecoder(draft, target, FixedK(2), cascade=Cascade("chow", 0.5))
    with pytest.raises(ValueError, match=r"runs on fast='static' or 'compile', not 'graphs': CUDA graphs do not "
                                         r"hand the draft"):
        StaticBatchFeatureTargetRunner(target, 32, False, draft.aux_layers, RowStores(), fast="graphs")


def test_a_feature_draft_for_another_target_is_refused(feature_pair32):
    draft, _, _ = feature_pair32
    other = tiny_lm(32, 16, 4, seed=9)
    with pytest.raises(ValueError, match=r"hidden_size"):
        SpeculativeDecoder(draft, other, FixedK(2)).generate(torch.tensor([[1, 2]]), 4)


def test_a_tree_levels_nodes_read_their_parents_states(feature_pair32):
    """SequoiaDecoder's draft levels on a feature draft: each fed node reads the output state of its
    parent (a depth-1 node: the root's), so its children's logits equal drafting along the node's
    path as a chain (features up to the root's entry, then the draft's own states); compact() drops
    the tree's entries."""
    from specdecpp.core.timing import Clock
    from specdecpp.decoders.sequoia import TreeDrafter, TreePlan
    from specdecpp.decoders.tree import TokenTree
    from specdecpp.models.feature_runner import feature_runners

    draft, target, _ = feature_pair32
    draft_runners, target_runners = feature_runners(draft, target)
    runner, verifier = draft_runners(draft, 32, False), target_runners(target, 32, False)
    seq = torch.tensor([3, 1, 4, 1, 5])
    verifier.feed(seq[:-1], 1)  # the target has read x_0..x_3: features g_0..g_3
    tree = TokenTree([-1, -1, 0, 0, 1, 2, 5])  # two children of the root, their children, two deeper levels
    plan = TreePlan.build(tree, "cpu")
    calls = []
    real = runner.feed

    def spy(ids, n_logits=1, position_ids=None, attention_mask=None):
        out = real(ids, n_logits, position_ids, attention_mask)
        calls.append((ids.clone(), out[0].clone()))
        return out

    runner.feed = spy
    block = TreeDrafter(runner, SamplingConfig(temperature=0), Clock("cpu")).grow(
        seq, seq.shape[0], plan, None)
    assert len(calls) == 1 + len(plan.fed)
    with torch.no_grad():
        feats = draft.fuse(target(seq[None, :-1], output_hidden_states=True).hidden_states)
        for level, (_ids, logits) in zip(plan.fed, calls[1:], strict=True):
            for j, v in enumerate(level):
                path = [int(block.tokens[a]) for a in tree.path(v)]  # the node's tokens from depth 1 down
                cache = draft.new_cache()
                out = draft(seq[None, 1:], features=feats, cache=cache, n_logits=1)  # entries 0..3: the root's last
                for tok in path:
                    out = draft(torch.tensor([[tok]]), hidden=out.hidden[:, -1:], cache=cache)
                torch.testing.assert_close(logits[j], out.logits[0, -1], atol=1e-4, rtol=1e-4)
    assert runner.cache.length > runner.from_target
    runner.compact(None)
    assert runner.cache.length == runner.from_target and not runner.tree


@pytest.mark.slow
def test_a_fresh_targets_feature_step_compiles_on_its_first_call():
    """A target that has never run: its first forward is the compiled feature step's (transformers
    installs its hidden-state hooks on the first call that asks for them, under a lock dynamo cannot
    trace: specdecpp.fast.features.prime_hidden_states), and the output is still the target's greedy."""
    target = tiny_lm(32, 32, 4, seed=5, scale=0.4)
    draft = _feature_draft(target, 6)
    out = SpeculativeDecoder(draft, target, FixedK(2), SamplingConfig(temperature=0), fast="compile").generate(
        torch.tensor([[1, 2, 3]]), max_new_tokens=8)
    assert out.tokens.tolist() == target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compact_at,fast", [(4, None), (32, None), (4, "static")],
                         ids=["compact_often", "default", "fast_static"])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)],
                         ids=["greedy", "T1"])
def test_batch_rows_draft_caches_equal_a_fresh_forward(feature_pair32, monkeypatch, sampling, compact_at, fast,
                                                       device):
    """Per-row batches (rows of other lengths, a one-token prompt, rows joining finished rows' slots,
    the draft's compactions; on the fast path the target's static cache of per-row lengths, rows
    moving between its buffer rows): each row's draft cache at its end equals a fresh draft forward
    over a fresh teacher-forced target forward's features of the row's kept tokens, so every row read
    its own target features, nothing of its batch-mates'."""
    import specdecpp.decoders.batch_features as batch_features

    monkeypatch.setattr(batch_features, "COMPACT_AT", compact_at)
    draft, target, heads = on(device, feature_pair32)
    decoder = SpeculativeDecoder(draft, target, SVIP(threshold=0.33, max_candidates=4), sampling, fast=fast)
    prompts = [[3, 1, 4], [7], [4, 4, 9, 10, 11, 3, 5], [2, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    outs = decoder.generate_batch([torch.tensor(p, device=device) for p in prompts], 24,
                                  [torch.Generator().manual_seed(b) for b in range(len(prompts))], batch_size=3,
                                  return_caches=True)
    assert sum(sum(o.stats.accept_lengths) for o in outs) > 0
    with torch.no_grad():
        for b, out in enumerate(outs):
            tokens, cache = out.tokens[0], out.caches["draft"]
            entries = cache.length
            assert 0 < entries <= tokens.shape[0] - 2, (b, entries)
            fresh = draft.fuse(target(tokens[None, : entries], output_hidden_states=True).hidden_states)
            ref = draft.new_cache()
            draft(tokens[None, 1 : entries + 1], features=fresh, cache=ref)
            for mine, want in zip(cache.keys + cache.values, ref.keys + ref.values, strict=True):
                torch.testing.assert_close(mine[:, :, :entries], want[:, :, :entries], atol=1e-3, rtol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fast", [None, "static"], ids=["eager", "fast_static"])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0, top_k=10)],
                         ids=["greedy", "T1-top10"])
def test_a_feature_batch_row_does_not_depend_on_its_batch_mates(feature_pair32, sampling, fast, device):
    """A prompt decoded alone, among other prompts, in another position, or joining a running batch
    (its own generator each time) gives the same tokens and the same rounds."""
    draft, target, heads = on(device, feature_pair32)
    decoder = SpeculativeDecoder(draft, target, SpecDecPP(heads["next"], 0.5, max_candidates=4), sampling,
                                 fast=fast)
    prompt, others = [4, 4, 9, 10, 11, 3, 5], [[3, 1, 4], [7], [2, 6, 1, 1]]

    def row(prompts, index, batch_size=None):
        gens = [torch.Generator().manual_seed(50 + j) for j in range(len(prompts))]
        gens[index] = torch.Generator().manual_seed(7)
        out = decoder.generate_batch([torch.tensor(p, device=device) for p in prompts], 30, gens,
                                     batch_size=batch_size)[index]
        return out.tokens.tolist(), out.stats.accept_lengths, out.stats.candidate_lengths

    alone = row([prompt], 0)
    assert row([prompt, *others[:2]], 0) == alone
    assert row([others[2], others[0], prompt], 2) == alone
    assert row([*others[:2], prompt], 2, batch_size=2) == alone  # takes a finished row's slot
    if sampling.greedy:
        cpu_target = feature_pair32[1]
        assert alone[0] == cpu_target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False).tolist()


@pytest.mark.slow
def test_compiled_feature_batches_compile_each_bucket_once():
    """fast='compile', generate_batch with a feature pair: warm_up(..., batch_size) compiles the
    target's (batch, width) feature steps once (the draft runs eagerly); then batches of other sizes
    (up to it), rows joining and leaving, and another decoder over the same models never compile
    again; every row equals the target's greedy decoding, and sampled rows equal the static path's
    seed for seed (which equals eager decoding: test_fast_sampled_output_equals_eager)."""
    from torch._dynamo.utils import counters

    target = tiny_lm(32, 32, 2, seed=25, scale=0.4)  # fresh models: their steps compile here
    draft = _feature_draft(target, 26)
    greedy = SamplingConfig(temperature=0)
    decoder = SpeculativeDecoder(draft, target, FixedK(1), greedy, fast="compile")
    graphs = counters["stats"]["unique_graphs"]
    assert decoder.warm_up(7, 21, batch_size=2) > 0
    assert counters["stats"]["unique_graphs"] - graphs == 4  # the target's widths 1, 2 x batches 1, 2
    steps = feature_model_steps(target, tuple(draft.aux_layers)).compile_seconds
    assert {(w, b) for w, _, b in steps} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    prompts = [[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]]
    refs = [target.generate(torch.tensor([p]), max_new_tokens=21, do_sample=False).tolist() for p in prompts]
    sampled = SamplingConfig(temperature=1.0, top_k=10)

    def rows(d, batch_size):
        gens = [torch.Generator().manual_seed(b) for b in range(len(prompts))]
        outs = d.generate_batch([torch.tensor(p) for p in prompts], 21, gens, batch_size=batch_size)
        return [(o.tokens.tolist(), o.stats.candidate_lengths, o.stats.accept_lengths) for o in outs]

    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch_size in (2, 1):  # 3 prompts: rows join as others finish
            got = rows(decoder, batch_size)
            assert [tokens for tokens, _, _ in got] == refs
            assert sum(sum(acc) for _, _, acc in got) > 0
        compiled = rows(SpeculativeDecoder(draft, target, FixedK(1), sampled, fast="compile"), 2)
    assert counters["stats"]["unique_graphs"] - graphs == 4
    assert compiled == rows(SpeculativeDecoder(draft, target, FixedK(1), sampled, fast="static"), 2)
