"""The fast path under the decoders (``fast=``, specdecpp.fast): the one check of the
argument in every constructor, what is refused (PEARL compiled, graphs on a CPU), cascades and
batches on the static cache, the per-call sizing that lets calls share compiled steps, Sequoia's
buckets, and (slow) a compiled decoder that compiles each bucket once across calls and decoders,
batches included.
Exactness of every decoder's fast variants: tests/decoders/test_exactness.py's registry."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from specdecpp import (
    SVIP,
    Cascade,
    FixedK,
    PEARLDecoder,
    SamplingConfig,
    SequoiaDecoder,
    SpeculativeDecoder,
    TargetOnly,
    TokenTree,
)
from specdecpp.decoders.sequoia import tree_buckets
from specdecpp.fast.buckets import MIN_MAX_LEN, call_max_len
from specdecpp.fast.calls import CallRunners
from specdecpp.fast.step import model_steps
from tests.helpers.tiny import noisy_copy, tiny_lm
from tests.models.test_static_runner import record_compiles

GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    return noisy_copy(target, 0.3, seed=6), target


def test_every_constructor_checks_fast(pair):
    draft, target = pair
    builders = {"SpeculativeDecoder": lambda f: SpeculativeDecoder(draft, target, FixedK(2), fast=f),
                "SequoiaDecoder": lambda f: SequoiaDecoder(draft, target, [-1, 0], fast=f),
                "PEARLDecoder": lambda f: PEARLDecoder(draft, target, 2, fast=f)}
    for name, build in builders.items():
        with pytest.raises(ValueError, match=f"{name}: fast must be one of None, 'static', 'compile', 'graphs', "
                                             "'compile-graphs', got 'turbo'"):
            build("turbo")
        for graphs in ("graphs", "compile-graphs"):
            with pytest.raises(ValueError, match=f"{name}: fast='{graphs}' needs CUDA; the models are on cpu"):
                build(graphs)
        assert build("static").fast == "static" and build(None).fast is None
    with pytest.raises(ValueError, match="PEARLDecoder: fast='compile' is not supported: PEARL runs the draft on a "
                                         "second thread"):
        PEARLDecoder(draft, target, 2, fast="compile")
    with pytest.raises(ValueError, match="PEARLDecoder: fast='compile'"):
        PEARLDecoder.check_settings(2, 1, None, "compile")  # what configs run before the models load
    with pytest.raises(ValueError, match="PEARLDecoder: fast='graphs' is not supported: PEARL runs the draft on a "
                                         "second thread"):
        PEARLDecoder.check_settings(2, 1, None, "graphs")  # refused as compile is, whatever the device
    with pytest.raises(ValueError, match="PEARLDecoder: fast='compile-graphs' is not supported"):
        PEARLDecoder.check_settings(2, 1, None, "compile-graphs")


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_batches_on_the_static_cache_equal_eager(pair, sampling):
    """generate_batch on the static batch runner emits what it emits eagerly (same generators;
    float32 logits agree to rounding), rows joining and leaving, for an exact decoder, one with
    fill and a cascade (its bonus token's draft forward)."""
    draft, target = pair
    prompts = [torch.tensor(p) for p in ([1, 2, 3], [9], [4, 4, 9, 10, 11, 3, 5], [30, 2], [5, 6])]
    for stop, cascade, fill in ((SVIP(threshold=0.3, max_candidates=5), None, False), (FixedK(3), None, True),
                                (FixedK(2), Cascade("opt", 0.2), False), (TargetOnly(), None, False)):
        outs = []
        for fast in (None, "static"):
            decoder = SpeculativeDecoder(draft, target, stop, sampling, cascade=cascade, fast=fast)
            gens = [torch.Generator().manual_seed(b) for b in range(len(prompts))]
            outs.append(decoder.generate_batch(prompts, 20, gens, batch_size=3, fill=fill))
        for eager, fast in zip(*outs, strict=True):
            assert eager.tokens.tolist() == fast.tokens.tolist()
            assert eager.stats.accept_lengths == fast.stats.accept_lengths
            assert eager.stats.n_draft_calls == fast.stats.n_draft_calls


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_cascade_on_the_static_cache_equals_eager(pair, sampling):
    """A cascade differs from exact decoding only in its rule: on the static cache it emits what
    it emits eagerly (same seeds; float32 logits agree to rounding)."""
    draft, target = pair
    for stop in (FixedK(3), SVIP(threshold=0.3, max_candidates=5)):
        eager, fast = (SpeculativeDecoder(draft, target, stop, sampling, cascade=Cascade("opt", 0.2), fast=f)
                       for f in (None, "static"))
        for prompt in ([1, 2, 3], [9, 4]):
            outs = [d.generate(torch.tensor([prompt]), 20, generator=torch.Generator().manual_seed(3))
                    for d in (eager, fast)]
            assert outs[0].tokens.tolist() == outs[1].tokens.tolist()
            assert outs[0].stats.accept_lengths == outs[1].stats.accept_lengths
            assert outs[0].stats.n_draft_calls == outs[1].stats.n_draft_calls  # the bonus token's draft forward


def test_calls_share_one_cache_size(pair):
    """The static caches' size is a power of two (at least MIN_MAX_LEN), independent of the
    buckets, and never shrinks: a shorter call after a longer one reuses its size (and so its
    compiled steps)."""
    draft, target = pair
    assert call_max_len(10, target) == MIN_MAX_LEN and call_max_len(300, target) == 512
    assert call_max_len(600, target) == 600  # tiny_lm's max_position_embeddings is 512: never below the need
    runners = CallRunners("static", (draft, target))
    narrow = runners(100, (1, 2))(draft, 32, False)
    wide = runners(100, (1, 2, 4, 8, 16, 32))(target, 32, False)
    assert narrow.cache.size == wide.cache.size == MIN_MAX_LEN and narrow.max_len == MIN_MAX_LEN - 2
    assert runners(300, (1, 2))(draft, 32, False).cache.size == 512
    assert runners(20, (1, 2))(draft, 32, False).cache.size == 512
    assert CallRunners(None, (draft, target))(100)(draft, 32, False).__class__.__name__ == "ModelRunner"

    decoder = SpeculativeDecoder(draft, target, FixedK(3), GREEDY, fast="static")
    sizes = set()
    for prompt, n in (([1] * 230, 40), ([2, 3], 5)):  # 230 + 40 + a round > 256
        out = decoder.generate(torch.tensor([prompt]), n, return_caches=True)
        sizes |= {out.caches[role].size for role in ("draft", "target")}
    assert sizes == {512}


def test_target_only_warms_up_no_draft_bucket(monkeypatch):
    """warm_up compiles only the models a decoder runs: target-only decoding never feeds the draft
    (one-row and batch calls), a cascade over it does (its rule reads the draft's logits), fixed K does;
    and target-only after its warm-up equals the target's greedy decoding without compiling more."""
    target = tiny_lm(32, 32, 2, seed=35, scale=0.4)  # fresh models: nothing compiled for them yet
    draft = noisy_copy(target, 0.3, seed=36)
    record_compiles(monkeypatch)
    target_only = SpeculativeDecoder(draft, target, TargetOnly(), GREEDY, fast="compile")
    target_only.warm_up(7, 12)
    target_only.warm_up(7, 12, batch_size=2)
    assert not model_steps(draft).compile_seconds and model_steps(target).compile_seconds
    compiled = set(model_steps(target).compile_seconds)
    ref = target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=12, do_sample=False).tolist()
    assert target_only.generate(torch.tensor([[1, 2, 3]]), 12).tokens.tolist() == ref
    outs = target_only.generate_batch([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], 12, batch_size=2)
    assert outs[0].tokens.tolist() == ref
    assert not model_steps(draft).compile_seconds and set(model_steps(target).compile_seconds) == compiled
    for policy, cascade in ((TargetOnly(), Cascade("diff", 0.1)), (FixedK(2), None)):
        other_draft = noisy_copy(target, 0.3, seed=37)
        SpeculativeDecoder(other_draft, target, policy, GREEDY, cascade=cascade, fast="compile").warm_up(7, 12)
        assert model_steps(other_draft).compile_seconds


def test_sequoia_buckets_are_the_tree_widths():
    two_level = TokenTree([-1, -1, 0, 0, 1])  # root children 0, 1; 0 has two children, 1 one
    assert tree_buckets(two_level) == {"target": (1, 3, 6), "draft": (1, 2)}
    assert tree_buckets(TokenTree.star(4)) == {"target": (1, 5), "draft": (1, 2)}
    wide = TokenTree.from_branching([[4], [2, 2, 1, 0], [1, 1, 1, 1, 1]])  # fed levels: 1 (root), 3, 5
    assert tree_buckets(wide) == {"target": (1, 5, 10, 15), "draft": (1, 2, 3, 5)}


@pytest.mark.slow
def test_compiled_decoders_compile_each_bucket_once_across_calls():
    """fast='compile': warm_up compiles each model's buckets once; then calls of other lengths
    (one cache size), another decoder over the same models (target-only, whose buckets are a
    subset) and a cascade never compile again, and the output equals the target's greedy decoding."""
    target = tiny_lm(32, 32, 2, seed=15, scale=0.4)  # fresh models: their steps compile here
    draft = noisy_copy(target, 0.3, seed=16)
    decoder = SpeculativeDecoder(draft, target, FixedK(3), GREEDY, fast="compile")
    graphs = counters["stats"]["unique_graphs"]
    assert decoder.warm_up(7, 30) > 0
    assert counters["stats"]["unique_graphs"] - graphs == 2 + 3  # draft 1, 2; target 1, 2, 4
    assert decoder.warm_up(7, 30) == pytest.approx(0, abs=1.0)  # nothing left to compile
    assert {w for w, _ in model_steps(target).compile_seconds} == {1, 2, 4}
    others = [SpeculativeDecoder(draft, target, TargetOnly(), GREEDY, fast="compile"),
              SpeculativeDecoder(draft, target, FixedK(3), GREEDY, cascade=Cascade("diff", 0.1), fast="compile")]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt, n in (([1, 2, 3], 30), ([7], 6), ([4, 4, 9, 10, 11, 3, 5], 21)):
            ref = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False).tolist()
            for d in decoder, others[0]:
                assert d.generate(torch.tensor([prompt]), n).tokens.tolist() == ref
            assert others[1].generate(torch.tensor([prompt]), n).stats.n_generated == n  # lossy: its own output
    assert counters["stats"]["unique_graphs"] - graphs == 5


@pytest.mark.slow
def test_compiled_batches_compile_each_bucket_once_across_calls():
    """fast='compile', generate_batch: warm_up(..., batch_size) compiles each model's (batch,
    width) buckets once; then batches of other sizes (up to it), rows joining and leaving, and
    another decoder over the same models never compile again, and every row equals the target's
    greedy decoding."""
    target = tiny_lm(32, 32, 2, seed=25, scale=0.4)  # fresh models: their steps compile here
    draft = noisy_copy(target, 0.3, seed=26)
    decoder = SpeculativeDecoder(draft, target, FixedK(1), GREEDY, fast="compile")
    graphs = counters["stats"]["unique_graphs"]
    assert decoder.warm_up(7, 21, batch_size=2) > 0
    assert counters["stats"]["unique_graphs"] - graphs == 4 + 4  # draft and target: widths 1, 2 x batches 1, 2
    assert {(w, b) for w, _, b in model_steps(target).compile_seconds} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    target_only = SpeculativeDecoder(draft, target, TargetOnly(), GREEDY, fast="compile")
    prompts = [[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]]
    refs = [target.generate(torch.tensor([p]), max_new_tokens=21, do_sample=False).tolist() for p in prompts]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for d in decoder, target_only:
            for batch_size in (2, 1):  # 3 prompts: rows join as others finish
                outs = d.generate_batch([torch.tensor(p) for p in prompts], 21, batch_size=batch_size)
                assert [o.tokens.tolist() for o in outs] == refs
    assert counters["stats"]["unique_graphs"] - graphs == 8
