"""The exactness tests every decoder passes before any speed claim, on the CPU and (marker ``gpu``)
on CUDA: greedy output equals the target's own greedy decoding, sampled output follows the target's
exact warped distribution (chi-square against enumeration, EOS included), and the same generator
seed gives the same output.

``DECODERS`` is the registry: a new decoder (a batch, a cascade against its own target) adds
its factories here and inherits every test. Each factory gets ``(draft, target, sampling, heads)``
where ``heads`` holds a paper head (lag 1) and a lag-free head (lag 0) whose stop decisions vary
with the drafted tokens on the test prompt."""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch

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
from specdecpp.core.compat import cache_kwargs
from specdecpp.core.hooks import new_cache
from tests.helpers import graph_tape
from tests.helpers.stats import chi_square_pvalue, exact_distribution, sampled_grid
from tests.helpers.tiny import noisy_copy, tiny_lm

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

MATES = ([3], [4, 1, 0, 2, 1])  # batch-mates of other lengths (token ids < 5 fit both test pairs)


class InBatch:
    """``generate_batch`` seen through one row: the prompt under test shares a batch with
    :data:`MATES` (their own generators), first and all rows at once, or last with
    ``batch_size=2`` so that it takes the slot a finished mate leaves (continuous batching)."""

    def __init__(self, decoder: SpeculativeDecoder, queued: bool = False, fill: bool = False) -> None:
        self.decoder, self.queued, self.fill = decoder, queued, fill

    def generate(self, prompt_ids, max_new_tokens, generator=None, eos_token_id=None, return_caches=False):
        device = prompt_ids.device
        mates = [torch.tensor(m, device=device) for m in MATES]
        prompts = [*mates, prompt_ids[0]] if self.queued else [prompt_ids[0], *mates]
        gens = None
        if generator is not None:
            mate_gens = [torch.Generator().manual_seed(100 + j) for j in range(len(mates))]
            gens = [*mate_gens, generator] if self.queued else [generator, *mate_gens]
        outs = self.decoder.generate_batch(prompts, max_new_tokens, gens, eos_token_id,
                                           batch_size=2 if self.queued else None, return_caches=return_caches,
                                           fill=self.fill)
        return outs[-1] if self.queued else outs[0]

    def sample(self, prompt: list[int], n: int, seed: int, eos_token_id, max_new_tokens: int, device) -> list:
        """``n`` decodes of ``prompt`` as rows of batches rather than one call each (the chi-square
        grid): rows of the prompt (each its own generator) between :data:`MATES`. Plain and fill
        runs decode calls of 16 rows at once; a queued one decodes every row in one call of at most
        16 rows at a time, each finished row's slot taken by the next (continuous batching). Returns
        the prompt rows' outputs."""
        per_call = 12 if not self.queued else n
        outs = []
        for call in range(-(-n // per_call)):
            rows = min(per_call, n - call * per_call)
            prompts, mine = [], []
            for i in range(rows):
                if i % 3 == 1:
                    prompts.append(MATES[(i // 3) % len(MATES)])
                mine.append(len(prompts))
                prompts.append(prompt)
            gens = [torch.Generator().manual_seed(seed + 100_003 * call + b) for b in range(len(prompts))]
            got = self.decoder.generate_batch([torch.tensor(p, device=device) for p in prompts], max_new_tokens,
                                              gens, eos_token_id, batch_size=16 if self.queued else None,
                                              fill=self.fill)
            outs += [got[b] for b in mine]
        return outs


DECODERS = {
    "chain-target_only": lambda d, t, s, h, **kw: SpeculativeDecoder(d, t, TargetOnly(), s, **kw),
    "chain-fixed_k3": lambda d, t, s, h, **kw: SpeculativeDecoder(d, t, FixedK(3), s, **kw),
    "chain-svip": lambda d, t, s, h, **kw: SpeculativeDecoder(d, t, SVIP(threshold=0.33, max_candidates=4), s, **kw),
    "chain-paper_head": lambda d, t, s, h, **kw: SpeculativeDecoder(
        d, t, SpecDecPP(h["paper"], 0.5, max_candidates=4), s, **kw),
    "chain-lag_free_head": lambda d, t, s, h, **kw: SpeculativeDecoder(
        d, t, SpecDecPP(h["next"], 0.5, max_candidates=4), s, **kw),
    "batch-fixed_k3": lambda d, t, s, h, **kw: InBatch(SpeculativeDecoder(d, t, FixedK(3), s, **kw)),
    "batch-svip": lambda d, t, s, h, **kw: InBatch(
        SpeculativeDecoder(d, t, SVIP(threshold=0.33, max_candidates=4), s, **kw)),
    "batch-paper_head": lambda d, t, s, h, **kw: InBatch(
        SpeculativeDecoder(d, t, SpecDecPP(h["paper"], 0.5, max_candidates=4), s, **kw)),
    "batch-lag_free_head": lambda d, t, s, h, **kw: InBatch(
        SpeculativeDecoder(d, t, SpecDecPP(h["next"], 0.5, max_candidates=4), s, **kw)),
    "batch_fill-paper_head": lambda d, t, s, h, **kw: InBatch(
        SpeculativeDecoder(d, t, SpecDecPP(h["paper"], 0.5, max_candidates=4), s, **kw), fill=True),
    "batch_queued-lag_free_head": lambda d, t, s, h, **kw: InBatch(
        SpeculativeDecoder(d, t, SpecDecPP(h["next"], 0.5, max_candidates=4), s, **kw), queued=True),
    "pearl-gamma2": lambda d, t, s, h, **kw: PEARLDecoder(d, t, 2, s, **kw),
    "pearl-svip": lambda d, t, s, h, **kw: PEARLDecoder(
        d, t, 3, s, policy=SVIP(threshold=0.33, max_candidates=4), **kw),
    "pearl-paper_head": lambda d, t, s, h, **kw: PEARLDecoder(
        d, t, 3, s, policy=SpecDecPP(h["paper"], 0.5, max_candidates=4), **kw),
    "pearl-lag_free_head": lambda d, t, s, h, **kw: PEARLDecoder(
        d, t, 3, s, policy=SpecDecPP(h["next"], 0.5, max_candidates=4), **kw),
    "sequoia-chain3": lambda d, t, s, h, **kw: SequoiaDecoder(d, t, [-1, 0, 1], s, **kw),
    # 4 > top-k 3: uniform fallback
    "sequoia-star4": lambda d, t, s, h, **kw: SequoiaDecoder(d, t, [-1, -1, -1, -1], s, **kw),
    "sequoia-two_level": lambda d, t, s, h, **kw: SequoiaDecoder(d, t, [-1, -1, 0, 0, 1], s, **kw),
}
# The fast path (specdecpp.fast): each decoder again on the static KV cache (``-fast_static``)
# and, slow (each width compiles once per process, seconds each), with its forwards compiled
# (``-fast_compile``; PEARL refuses it). Batches run on the static batch runner (static cache of
# per-row lengths, (batch, width) buckets). ``-fast_graphs`` (CUDA graphs; PEARL refuses it) runs on
# CUDA under ``gpu`` and on the CPU over the fake capture that keeps a CUDA graph's rules
# (tests/helpers/graph_tape.py, installed by ``fake_graphs_on_cpu``; its chi-square cases slow there);
# ``-fast_compile-graphs`` (compiled, then captured; slow too) on CUDA only: marked ``gpu``, its CPU
# cases left out of ``registry`` and skipped in the chi-square grid (``on``).
FAST_SLOW = {"static": False, "compile": True}
GRAPHS = ("graphs", "compile-graphs")
for _name in list(DECODERS):
    for _fast in (*FAST_SLOW, *GRAPHS):
        if _fast in PEARLDecoder.FAST or not _name.startswith("pearl"):
            DECODERS[f"{_name}-fast_{_fast}"] = functools.partial(DECODERS[_name], fast=_fast)


def on_cuda_only(name: str) -> bool:
    return name.endswith("-fast_compile-graphs")


def faked_on_cpu(name: str) -> bool:
    """A graphs variant, which on the CPU runs over the fake capture."""
    return name.endswith("-fast_graphs")


def marks(name: str, slow: bool = False) -> list:
    """``gpu`` for a compile-graphs variant, ``slow`` where ``slow`` or compiled."""
    compiled = name.endswith(("-fast_compile", "-fast_compile-graphs"))
    return [pytest.mark.gpu] * on_cuda_only(name) + [pytest.mark.slow] * (slow or compiled)


def registry(slow=lambda name: False) -> list:
    """The registry's (name, device) parameters: CUDA cases marked ``gpu``, ``slow`` where ``slow(name)``
    or compiled; no CPU case of a compile-graphs variant (a graphs variant's runs over the fake capture)."""
    out = []
    for n in DECODERS:
        for device in ("cpu", "cuda"):
            if device == "cpu" and on_cuda_only(n):
                continue
            out.append(pytest.param(n, device, id=f"{n}-{device}", marks=[pytest.mark.gpu] * (device == "cuda") + [
                pytest.mark.slow] * bool(slow(n) or n.endswith(("-fast_compile", "-fast_compile-graphs")))))
    return out


@pytest.fixture(autouse=True)
def fake_graphs_on_cpu(request, monkeypatch):
    """A graphs variant's CPU case runs over the fake capture (tests/helpers/graph_tape.py)."""
    spec = getattr(request.node, "callspec", None)
    if spec is not None and spec.params.get("device") == "cpu" and faked_on_cpu(str(spec.params.get("name", ""))):
        graph_tape.install(monkeypatch)


PROMPT = [0, 1]  # the chi-square prompt; the heads are centred so their stop varies here


def _pair6():
    target = tiny_lm(5, 16, 2, seed=21, scale=0.8, heads=2)
    return noisy_copy(target, 0.25, seed=22), target


def _heads(draft) -> dict:
    """A paper head and a lag-free head over the 16-wide draft, each centred on the test prompt so
    that whether a round stops depends on the drafted tokens."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        paper, lag_free = AcceptanceHead(16, 1), NextTokenHead(16, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        paper.out.weight.normal_(0, 1.0, generator=g)
        contexts = torch.tensor([PROMPT + [a] for a in range(5)])  # e_1 decides stop-at-2 vs go on
        hidden = draft(contexts, output_hidden_states=True).hidden_states[-1][:, -1]
        paper.out.bias.sub_(paper(hidden).median() + 0.1)
        lag_free.out.weight.normal_(0, 1.0, generator=g)
        lag_free.attach(draft)
        out = draft(torch.tensor([PROMPT]), output_hidden_states=True)
        e0, logits = out.hidden_states[-1][0, -1], out.logits[0, -1]
        scores = torch.stack([lag_free.score(e0, logits, torch.tensor(y)) for y in range(5)])
        lag_free.out.bias.sub_(scores.median() + 0.05)
    return {"paper": paper, "next": lag_free}


@functools.cache
def _cpu_pair6():
    draft, target = _pair6()
    return draft, target, _heads(draft)


@pytest.fixture(scope="module")
def cpu_pair6():
    return _cpu_pair6()


@pytest.fixture(scope="module")
def cpu_pair32():
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    draft = noisy_copy(target, 0.3, seed=6)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        heads = {"paper": AcceptanceHead(32, 2), "next": NextTokenHead(32, 1)}
    return draft, target, heads


def on(device: str, pair, name: str = ""):
    """The pair and heads on ``device`` (copies; the CPU originals stay for the references); a
    compile-graphs decoder ``name`` runs on CUDA only (a graphs one on the CPU over the fake capture,
    ``fake_graphs_on_cpu``; the CPU's refusal of real graphs: test_fast_decoders.py)."""
    if device == "cpu" and on_cuda_only(name):
        pytest.skip(f"fast={name.split('-fast_')[1]!r} needs CUDA")
    if device == "cpu":
        return pair
    draft, target, heads = pair
    return (copy.deepcopy(draft).to(device), copy.deepcopy(target).to(device),
            {k: copy.deepcopy(h).to(device) for k, h in heads.items()})


def assert_cache_is_fresh_prefill(model, cache, tokens: torch.Tensor, length: int) -> None:
    """``cache`` holds exactly what a fresh prefill of ``tokens[:length]`` computes (to float32
    rounding: CUDA's kernels for a batch of ragged rows and for one row differ by about 2e-5; on the CPU
    PEARL's T=1 caches reached 1.34e-5 on one element of 672 after the draw changed)."""
    atol, rtol = (2e-5, 1e-4) if tokens.device.type == "cpu" else (1e-4, 1e-3)
    fresh = new_cache(model)
    with torch.no_grad():
        model(tokens[:length].unsqueeze(0), use_cache=True, **cache_kwargs(model, fresh))
    for mine, ref in zip(cache.layers, fresh.layers, strict=True):
        assert mine.keys.shape == ref.keys.shape
        torch.testing.assert_close(mine.keys, ref.keys, atol=atol, rtol=rtol)
        torch.testing.assert_close(mine.values, ref.values, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name,device", registry())
def test_greedy_equals_target_greedy(cpu_pair32, name, device):
    draft, target, heads = on(device, cpu_pair32, name)
    decoder = DECODERS[name](draft, target, SamplingConfig(temperature=0), heads)
    cpu_target = cpu_pair32[1]
    for prompt, n in itertools.product([[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]], (1, 6, 21)):
        ref = cpu_target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        out = decoder.generate(torch.tensor([prompt], device=device), max_new_tokens=n)
        assert out.tokens.cpu().tolist() == ref.tolist(), (name, prompt, n)
        assert out.stats.n_generated == n


SAMPLINGS = [
    pytest.param(SamplingConfig(temperature=1.0), None, id="T1"),
    pytest.param(SamplingConfig(temperature=0.8, top_k=3), 2, id="T0.8-top3-eos2"),  # EOS = token 2
]


CHI_SQUARE_CALLS = 1200  # decodes a chi-square case samples
SAME_AS_EAGER_CALLS = 240  # decodes a fast variant's CPU case compares with the eager decoder's


def sampled_tokens(decoder, name: str, sampling, eos, device, n: int, seed: int = 1234) -> list:
    """``n`` decodes of :data:`PROMPT` by ``decoder`` from one seed: one call each (one generator
    through all of them), or a batch's rows (:meth:`InBatch.sample`). Chains generate 4 tokens, so a
    first round may draft 3 and the adaptive policies' stop decisions vary inside the window; PEARL
    generates 3, so pending drafts are cut at the length limit."""
    n_new = 3 if name.startswith("pearl") else 4
    if isinstance(decoder, InBatch):  # the rows of batches, not n calls
        return decoder.sample(PROMPT, n, seed, eos, n_new, device)
    g = torch.Generator().manual_seed(seed)
    return [decoder.generate(torch.tensor([PROMPT], device=device), generator=g, eos_token_id=eos,
                             max_new_tokens=n_new) for _ in range(n)]


def same_as_eager(name: str) -> bool:
    """A variant whose decodes repeat its eager decoder's seed for seed: the static cache and the
    compiled steps. Captured rounds (``-fast_graphs``) draw a round's uniforms at once, for the
    inverse-CDF draws a graph can hold (specdecpp/decoders/captured.py): exact in distribution, with
    other tokens than eager's from the same seed."""
    return name.endswith(("-fast_static", "-fast_compile"))


# batches one row per call are slow everywhere (test_batch.py samples whole batches), and so are the
# compiled variants; on the CPU, make test samples the paper head and one decoder of each other kind,
# make test-full all of them. The static and compiled variants' CPU cases are
# test_fast_sampled_output_equals_eager's.
@pytest.mark.parametrize("name,sampling,eos,device", [p for p in sampled_grid(
    [pytest.param(n, id=n, marks=marks(n, n.startswith("batch") and not (on_cuda_only(n) or faked_on_cpu(n))))
     for n in DECODERS],
    SAMPLINGS, DEVICES, fast={"chain-paper_head-T1", "chain-lag_free_head-T0.8-top3-eos2", "pearl-gamma2-T1",
                              "sequoia-two_level-T0.8-top3-eos2"})
    if not (p.values[3] == "cpu" and same_as_eager(p.values[0]))])
def test_sampled_output_has_target_distribution(cpu_pair6, name, sampling, eos, device):
    """The first 3 generated tokens (fewer when EOS ends a sequence) of 1,200 decodes follow the
    target's exact warped distribution (:func:`sampled_tokens`)."""
    draft, target, heads = on(device, cpu_pair6, name)
    expected = exact_distribution(cpu_pair6[1], PROMPT, 3, sampling, eos)
    decoder = DECODERS[name](draft, target, sampling, heads)
    seqs, first_k, accepted, post = [], set(), 0, 0
    for out in sampled_tokens(decoder, name, sampling, eos, device, CHI_SQUARE_CALLS):
        seqs.append(tuple(out.tokens[0, len(PROMPT): len(PROMPT) + 3].tolist()))
        first_k.add(out.stats.candidate_lengths[0])
        accepted += sum(out.stats.accept_lengths)
        post += getattr(out.stats, "n_post_verify_rounds", 0)
    assert chi_square_pvalue(seqs, expected) > 1e-4, name
    if name.startswith("pearl-"):
        assert post > 12  # PEARL's post-verify rounds (pending drafts) were exercised
    if name.split("-fast_")[0] != "chain-target_only":
        assert accepted > 300  # the acceptance path is exercised, not only resampling
    if not name.startswith(("pearl-", "batch_fill-")) and name.split("-")[1] in ("svip", "paper_head", "lag_free_head"):
        assert len(first_k) >= 2, first_k  # the adaptive stop really varies (fill: the longest row's K for all)


@functools.cache
def _eager_reference(base: str, sampling_id: str) -> list:
    """The eager decoder ``base``'s :data:`SAME_AS_EAGER_CALLS` CPU decodes (once a worker)."""
    sampling, eos = SAMPLING_BY_ID[sampling_id]
    draft, target, heads = _cpu_pair6()
    decoder = DECODERS[base](draft, target, sampling, heads)
    return [record(out) for out in sampled_tokens(decoder, base, sampling, eos, "cpu", SAME_AS_EAGER_CALLS)]


def record(out) -> tuple:
    """What a decode must repeat exactly: its tokens and every round's candidate and accepted lengths."""
    return (out.tokens.tolist(), list(out.stats.candidate_lengths), list(out.stats.accept_lengths))


SAMPLING_BY_ID = {p.id: tuple(p.values) for p in SAMPLINGS}


# The static cache and the compiled steps change how a forward is computed, never what a round does
# with it: on the CPU each such variant repeats its eager decoder's decodes exactly, seed for seed
# (tokens, candidate and accepted lengths of every round), and the eager decoder passes the
# chi-square above. That is a stronger check a decode than a second chi-square (any difference fails,
# not only one that moves the distribution), over 240 decodes rather than 1,200 (docs/testing.md).
# Captured rounds (``-fast_graphs``, :func:`same_as_eager`) and every CUDA case keep a chi-square
# of their own (CUDA's kernels round otherwise than the CPU's).
@pytest.mark.parametrize("name,sampling_id", [
    pytest.param(n, s.id, id=f"{n}-{s.id}", marks=marks(n, n.startswith("batch") and not faked_on_cpu(n))
                 + [pytest.mark.slow] * (f"{n}-{s.id}" != "chain-svip-fast_static-T1"))
    for n in DECODERS if same_as_eager(n) for s in SAMPLINGS])
def test_fast_sampled_output_equals_eager(cpu_pair6, name, sampling_id):
    base = name.split("-fast_")[0]
    reference = _eager_reference(base, sampling_id)
    sampling, eos = SAMPLING_BY_ID[sampling_id]
    draft, target, heads = cpu_pair6
    decoder = DECODERS[name](draft, target, sampling, heads)
    got = [record(out) for out in sampled_tokens(decoder, name, sampling, eos, "cpu", SAME_AS_EAGER_CALLS)]
    diverged = [i for i, (a, b) in enumerate(zip(got, reference, strict=True)) if a != b]
    assert not diverged, f"{name}: {len(diverged)} of {SAME_AS_EAGER_CALLS} decodes differ from {base}'s, " \
                         f"the first at {diverged[0]}: {got[diverged[0]]} against {reference[diverged[0]]}"


@pytest.mark.parametrize("name,device", registry())
def test_same_seed_same_output(cpu_pair32, name, device):
    draft, target, heads = on(device, cpu_pair32, name)
    decoder = DECODERS[name](draft, target, SamplingConfig(temperature=1.0, top_k=10), heads)

    def run(seed):
        out = decoder.generate(torch.tensor([[1, 2]], device=device), 24,
                               generator=torch.Generator().manual_seed(seed))
        return out.tokens.tolist(), out.stats.accept_lengths, out.stats.candidate_lengths

    first = run(0)
    assert run(0) == first and run(1) != first


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)],
                         ids=["greedy", "T1"])
@pytest.mark.parametrize("name", ["chain-fixed_k3", "chain-lag_free_head", "pearl-gamma2", "pearl-paper_head",
                                  "batch-paper_head", "batch_queued-lag_free_head",
                                  "sequoia-chain3", "sequoia-two_level", "chain-lag_free_head-fast_static",
                                  "pearl-paper_head-fast_static", "sequoia-two_level-fast_static",
                                  "batch_queued-lag_free_head-fast_static"])
def test_caches_after_many_rounds_equal_fresh_prefill(cpu_pair32, name, sampling, device):
    """After many rounds of rollbacks, each model's cache equals a fresh prefill of the tokens it
    holds (the target: every committed token but the newest; the draft: at most that)."""
    draft, target, heads = on(device, cpu_pair32, name)
    decoder = DECODERS[name](draft, target, sampling, heads)
    out = decoder.generate(torch.tensor([[3, 1, 4]], device=device), 40,
                           generator=torch.Generator().manual_seed(3), return_caches=True)
    tokens, s = out.tokens[0], out.stats
    assert len(s.accept_lengths) > 5 and min(s.accept_lengths) < max(s.candidate_lengths)  # rollbacks happened
    for role, model in (("target", target), ("draft", draft)):
        cache = out.caches[role]
        length = cache.get_seq_length()
        assert length == len(tokens) - 1 if role == "target" else length <= len(tokens) - 1
        assert_cache_is_fresh_prefill(model, cache, tokens, length)


@pytest.mark.slow  # make test runs test_chain.py's negative control of the same test
def test_the_distribution_test_rejects_the_draft_alone(cpu_pair6):
    """Negative control for the chi-square test above: the draft in the target's seat fails it."""
    draft, target, heads = cpu_pair6
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_distribution(target, PROMPT, 3, sampling)
    decoder = DECODERS["pearl-paper_head"](target, draft, sampling, heads)
    g = torch.Generator().manual_seed(7)
    seqs = [tuple(decoder.generate(torch.tensor([PROMPT]), 3, generator=g).tokens[0, 2:].tolist())
            for _ in range(1200)]
    assert chi_square_pvalue(seqs, expected) < 1e-6
