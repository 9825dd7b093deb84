"""``SpeculativeDecoder.generate_batch``: every row stops at its own candidate length.

For every policy (fixed K, SVIP, both head kinds), on the CPU and (marker ``gpu``) on CUDA:
greedy rows equal the target's own greedy decoding of each prompt (prompts of different lengths,
EOS in some rows, all rows at once and continuously batched); sampled rows have the target's
exact warped distribution (chi-square, every row of a batch of mixed prompts counts); the same
per-row generators give the same batch output; a row's output does not depend on its batch-mates;
every row's caches equal a fresh prefill of its tokens after many ragged rounds (with and without
compactions). The registry entries ``batch-*`` of test_exactness.py run the same decoders through
the shared tests one row at a time."""

# ruff: noqa: F811 (test arguments named as the fixtures imported from test_exactness)
from __future__ import annotations

import pytest
import torch
from test_exactness import (  # the registry's pairs and heads (fixtures), reused as they are
    DEVICES,
    PROMPT,
    SAMPLINGS,
    assert_cache_is_fresh_prefill,
    cpu_pair6,  # noqa: F401
    cpu_pair32,  # noqa: F401
    on,
)

import specdecpp.decoders.batch
from specdecpp import (
    SVIP,
    FixedK,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
    StopPolicy,
    TargetOnly,
)
from tests.helpers.stats import chi_square_pvalue, exact_distribution, sampled_grid

POLICIES = {
    "fixed_k3": lambda h: FixedK(3),
    "svip": lambda h: SVIP(threshold=0.33, max_candidates=4),
    "paper_head": lambda h: SpecDecPP(h["paper"], 0.5, max_candidates=4),
    "lag_free_head": lambda h: SpecDecPP(h["next"], 0.5, max_candidates=4),
    # fill=True: a row whose policy stopped drafts on while another row's policy still drafts
    "svip+fill": lambda h: SVIP(threshold=0.33, max_candidates=4),
    "paper_head+fill": lambda h: SpecDecPP(h["paper"], 0.5, max_candidates=4),
}


class Filling:
    """A decoder whose ``generate_batch`` runs with ``fill=True``."""

    def __init__(self, decoder: SpeculativeDecoder) -> None:
        self.decoder = decoder

    def generate_batch(self, *args, **kwargs):
        return self.decoder.generate_batch(*args, fill=True, **kwargs)
PROMPTS = [[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5], [30, 2], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
EOS = 2  # within 24 tokens the target's greedy continuation reaches it in rows 0, 2, 3, not in 1, 4


def decoder(pair, policy: str, sampling: SamplingConfig) -> SpeculativeDecoder | Filling:
    """``policy``'s decoder; ``+static`` on the name: on the fast path's static batch runner."""
    draft, target, heads = pair
    static = policy.endswith("+static")
    policy = policy.removesuffix("+static")
    dec = SpeculativeDecoder(draft, target, POLICIES[policy](heads), sampling, fast="static" if static else None)
    return Filling(dec) if policy.endswith("+fill") else dec


def tensors(prompts, device) -> list[torch.Tensor]:
    return [torch.tensor(p, device=device) for p in prompts]


def greedy_reference(target, prompt, n, eos=None) -> list[int]:
    """The target's own greedy decoding (transformers' generate), cut after the first EOS."""
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0].tolist()
    new = out[len(prompt):]
    return out[: len(prompt) + new.index(eos) + 1] if eos in new else out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_size", [None, 2], ids=["all_rows", "slots2"])
@pytest.mark.parametrize("policy", list(POLICIES) + ["target_only"])
def test_greedy_rows_equal_target_greedy(cpu_pair32, policy, batch_size, device):
    pair = on(device, cpu_pair32)
    if policy == "target_only":
        dec = SpeculativeDecoder(pair[0], pair[1], TargetOnly(), SamplingConfig(temperature=0))
    else:
        dec = decoder(pair, policy, SamplingConfig(temperature=0))
    outs = dec.generate_batch(tensors(PROMPTS, device), 24, eos_token_id=EOS, batch_size=batch_size)
    ended = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = greedy_reference(cpu_pair32[1], prompt, 24, EOS)
        assert out.tokens.cpu().tolist() == [ref], (policy, prompt)
        assert out.stats.n_generated == len(ref) - len(prompt)
        assert out.batch_size == (batch_size or len(PROMPTS))
        ended.append(ref[-1] == EOS)
    assert ended == [True, False, True, True, False]  # EOS in some rows, the length limit in others
    if policy != "target_only":
        lengths = {k for out in outs for k in out.stats.candidate_lengths}
        assert max(lengths) > 1


@pytest.mark.parametrize("policy,sampling,eos,device", sampled_grid(
    [pytest.param(p, id=p) for p in [*POLICIES, "lag_free_head+static", "paper_head+fill+static"]], SAMPLINGS, DEVICES,
    fast={"paper_head+fill-T1", "lag_free_head-T0.8-top3-eos2",  # on the CPU, the rest: make test-full
          "lag_free_head+static-T0.8-top3-eos2"}))
def test_sampled_rows_have_target_distribution(cpu_pair6, policy, sampling, eos, device):
    """Each call decodes a batch of mixed prompts: four rows of the test prompt (each its own
    generator) between rows of other lengths; every test-prompt row is one sample of its first 3
    generated tokens (fewer at EOS), 1,200 in all."""
    pair = on(device, cpu_pair6)
    expected = exact_distribution(cpu_pair6[1], PROMPT, 3, sampling, eos)
    dec = decoder(pair, policy, sampling)
    prompts = [PROMPT, [3], PROMPT, [4, 1, 0, 2, 1], PROMPT, PROMPT]
    rows = [b for b, p in enumerate(prompts) if p == PROMPT]
    seqs, first_k, accepted = [], set(), 0
    for call in range(1200 // len(rows)):
        gens = [torch.Generator().manual_seed(10_000 * call + b) for b in range(len(prompts))]
        outs = dec.generate_batch(tensors(prompts, device), 4, gens, eos_token_id=eos)
        for b in rows:
            seqs.append(tuple(outs[b].tokens[0, len(PROMPT): len(PROMPT) + 3].tolist()))
            first_k.add(outs[b].stats.candidate_lengths[0])
            accepted += sum(outs[b].stats.accept_lengths)
    assert len(seqs) == 1200
    assert chi_square_pvalue(seqs, expected) > 1e-4, policy
    assert accepted > 300  # the acceptance path is exercised, not only resampling
    if policy != "fixed_k3" and "+fill" not in policy:  # fill: the longest row's K for all
        assert len(first_k) >= 2, first_k  # the adaptive stop really varies between rows


def test_the_batched_distribution_test_rejects_the_draft_alone(cpu_pair6):
    """Negative control: with the draft in the target's seat the batched samples fail the test."""
    draft, target, heads = cpu_pair6
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_distribution(target, PROMPT, 3, sampling)
    dec = SpeculativeDecoder(target, draft, FixedK(2), sampling)
    seqs = []
    for call in range(300):
        gens = [torch.Generator().manual_seed(10_000 * call + b) for b in range(4)]
        outs = dec.generate_batch(tensors([PROMPT] * 4, "cpu"), 3, gens)
        seqs += [tuple(o.tokens[0, 2:].tolist()) for o in outs]
    assert chi_square_pvalue(seqs, expected) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_same_generators_same_batch_output(cpu_pair32, policy, device):
    dec = decoder(on(device, cpu_pair32), policy, SamplingConfig(temperature=1.0, top_k=10))

    def run(seed):
        gens = [torch.Generator().manual_seed(seed + b) for b in range(len(PROMPTS))]
        outs = dec.generate_batch(tensors(PROMPTS, device), 24, gens, batch_size=3)
        return [(o.tokens.tolist(), o.stats.accept_lengths, o.stats.candidate_lengths) for o in outs]

    first = run(0)
    assert run(0) == first
    other = run(100)
    assert all(a[0] != b[0] for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_row_does_not_depend_on_its_batch_mates(cpu_pair32, policy, device):
    """Greedy: a prompt decoded alone, among other prompts, in another position, or joining a
    running batch gives the same tokens and the same rounds (with fill the same tokens: its rounds
    follow its batch-mates' policies by design)."""
    dec = decoder(on(device, cpu_pair32), policy, SamplingConfig(temperature=0))
    prompt = PROMPTS[2]

    def row(prompts, index, batch_size=None):
        out = dec.generate_batch(tensors(prompts, device), 30, batch_size=batch_size)[index]
        if policy.endswith("+fill"):
            return out.tokens.tolist()
        return out.tokens.tolist(), out.stats.accept_lengths, out.stats.candidate_lengths

    alone = row([prompt], 0)
    assert row([prompt, *PROMPTS[:2]], 0) == alone
    assert row([PROMPTS[4], PROMPTS[3], prompt], 2) == alone
    assert row([*PROMPTS[:2], prompt], 2, batch_size=2) == alone  # takes a finished row's slot
    assert (alone if policy.endswith("+fill") else alone[0]) == [greedy_reference(cpu_pair32[1], prompt, 30)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compact_at", [4, specdecpp.decoders.batch.COMPACT_AT], ids=["compact_often", "default"])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)],
                         ids=["greedy", "T1"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_rows_caches_equal_fresh_prefill(cpu_pair32, policy, sampling, compact_at, device, monkeypatch):
    """After many ragged rounds (rows drafting different K, rejecting, finishing, joining) each
    row's cache (its columns of the batch cache) equals a fresh prefill of its tokens: the
    target's every committed token but the newest, the draft's at most that."""
    monkeypatch.setattr(specdecpp.decoders.batch, "COMPACT_AT", compact_at)
    compactions = []
    compact = specdecpp.decoders.batch.BatchRunner.compact
    monkeypatch.setattr(specdecpp.decoders.batch.BatchRunner, "compact",
                        lambda self: compactions.append(self.width) or compact(self))
    draft, target, heads = on(device, cpu_pair32)
    dec = decoder((draft, target, heads), policy, sampling)
    gens = [torch.Generator().manual_seed(b) for b in range(len(PROMPTS))]
    outs = dec.generate_batch(tensors(PROMPTS, device), 40, gens, batch_size=3, return_caches=True)
    if compact_at == 4 or (device == "cpu" and sampling.greedy):  # holes were compacted away at least once;
        assert compactions  # with the default threshold that depends on the run (the random stream, under sampling)
    for out in outs:
        tokens, s = out.tokens[0], out.stats
        assert len(s.accept_lengths) > 5 and min(s.accept_lengths) < max(s.candidate_lengths)  # rollbacks
        for role, model in (("target", target), ("draft", draft)):
            cache = out.caches[role]
            length = cache.get_seq_length()
            assert length == len(tokens) - 1 if role == "target" else 0 < length <= len(tokens) - 1
            assert_cache_is_fresh_prefill(model, cache, tokens, length)


@pytest.mark.parametrize("policy", ["svip", "paper_head", "lag_free_head"])
def test_stop_rows_is_should_stop_for_every_row(cpu_pair32, policy):
    """A policy's batched decision equals its one-row decision row by row, round state included."""
    draft, _, heads = cpu_pair32
    batched, single = POLICIES[policy](heads), POLICIES[policy](heads)
    for p in (batched, single):
        p.bind(draft, 1.0)
    g = torch.Generator().manual_seed(0)
    rows = 6
    batched.begin_round()
    single_rounds = [1.0] * rows
    for k in range(1, 5):
        logits = torch.randn(rows, 32, generator=g) * 3
        hidden = torch.randn(rows, 32, generator=g)
        tokens = torch.randint(0, 32, (rows,), generator=g)
        got = batched.stop_rows(k, logits, hidden, tokens, torch.ones(rows, dtype=torch.bool))
        assert got.dtype == torch.bool and got.shape == (rows,)
        want = []
        for b in range(rows):  # each row's own round state (SpecDecPP's product), through should_stop
            if isinstance(single, SpecDecPP):
                single._p_one = single_rounds[b]
            want.append(single.should_stop(k, logits[b], hidden[b], tokens[b]))
            single_rounds[b] = getattr(single, "_p_one", None)
        assert got.tolist() == want, k


def test_fill_drafts_every_row_to_the_rounds_longest_policy(cpu_pair32):
    """Same per-row generators, so both runs draft the same first candidates: without fill the
    rows' first-round K differ; with fill every row drafts the longest of them. In every round of
    the filled run the rows' K equal the round's longest K, except rows bounded by their room."""
    sampling = SamplingConfig(temperature=1.0)
    prompts = tensors(PROMPTS, "cpu")

    def run(name):
        gens = [torch.Generator().manual_seed(50 + b) for b in range(len(prompts))]
        return decoder(cpu_pair32, name, sampling).generate_batch(prompts, 24, gens)

    per_row, filled = run("paper_head"), run("paper_head+fill")  # SVIP stops at 1 on every row here
    first = [o.stats.candidate_lengths[0] for o in per_row]
    assert len(set(first)) > 1, first  # the policy's own lengths differ between rows
    assert [o.stats.candidate_lengths[0] for o in filled] == [max(first)] * len(prompts)
    for r, (rows, longest, forwards) in enumerate(filled[0].batch_rounds):
        alive = [o for o in filled if len(o.stats.candidate_lengths) > r]
        ks = [o.stats.candidate_lengths[r] for o in alive]
        room = [24 - sum(o.stats.accept_lengths[:r]) - r - 1 for o in alive]  # room - 1 before round r
        assert len(ks) == rows and max(ks) == longest and forwards == longest, r
        assert all(k == longest or k == m for k, m in zip(ks, room, strict=True)), (r, ks, room)


def test_a_policy_without_stop_rows_is_refused_clearly(cpu_pair32):
    class OneRow(StopPolicy):
        max_candidates = 3

        def should_stop(self, k, logits, hidden, token=None):
            return k >= 2

    draft, target, _ = cpu_pair32
    dec = SpeculativeDecoder(draft, target, OneRow(), SamplingConfig(temperature=0))
    with pytest.raises(NotImplementedError, match="stop_rows"):
        dec.generate_batch(tensors(PROMPTS[:2], "cpu"), 5)


@pytest.mark.parametrize("kwargs,match", [
    ({"prompts": []}, "empty list"),
    ({"prompts": torch.tensor([1, 2])}, "list of 1-D LongTensors"),
    ({"prompts": [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)]}, r"prompts\[1\] is empty"),
    ({"prompts": [torch.tensor([[1, 2]])]}, r"prompts\[0\] must be a 1-D LongTensor"),
    ({"prompts": [torch.tensor([1.0, 2.0])]}, r"prompts\[0\] must be a 1-D LongTensor"),
    ({"generators": [torch.Generator()]}, "one torch.Generator per prompt"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"fill": "yes"}, "fill must be True or False"),
])
def test_bad_batch_arguments_are_clear_errors(cpu_pair32, kwargs, match):
    draft, target, _ = cpu_pair32
    dec = SpeculativeDecoder(draft, target, FixedK(2), SamplingConfig(temperature=0))
    args = {"prompts": tensors(PROMPTS[:2], "cpu"), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        dec.generate_batch(**args)


def test_trim_left_drops_the_cache_columns_with_the_mask_columns():
    """trim_left keeps the cache and the mask the same width: leading columns no row attends to go
    from both, also when no row attends to any column."""
    from transformers import DynamicCache

    from specdecpp.decoders.batch import trim_left

    def cache_of(width):
        cache = DynamicCache()
        cache.update(torch.randn(2, 1, width, 4), torch.randn(2, 1, width, 4), 0)
        return cache

    cache = cache_of(5)
    keys = cache.layers[0].keys.clone()
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    kept = trim_left(cache, mask)
    assert kept.tolist() == mask[:, 2:].tolist()
    assert torch.equal(cache.layers[0].keys, keys[:, :, 2:])
    cache = cache_of(3)
    kept = trim_left(cache, torch.zeros(2, 3, dtype=torch.bool))
    assert kept.shape == (2, 0) and cache.layers[0].keys.shape[2] == 0 and cache.layers[0].values.shape[2] == 0
