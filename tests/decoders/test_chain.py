"""The engine is lossless: greedy equality, the target's distribution, caches equal a fresh prefill."""

import copy
import itertools

import pytest
import torch

from specdecpp import (
    SVIP,
    AcceptanceHead,
    FixedK,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
    TargetOnly,
)
from tests.helpers.stats import chi_square_pvalue, exact_distribution
from tests.helpers.tiny import ConstantHead, noisy_copy, tiny_lm


def policies(hidden):
    return {
        "target_only": TargetOnly(),
        "fixed_k1": FixedK(1),
        "fixed_k4": FixedK(4),
        "svip": SVIP(threshold=0.35, max_candidates=6),
        "specdecpp": SpecDecPP(AcceptanceHead(hidden, 2), threshold=0.5, max_candidates=5),
        "specdecpp_h0": SpecDecPP(ConstantHead(hidden, 1.0), threshold=0.0),  # always one candidate
    }


@pytest.fixture(scope="module")
def pair32():
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    return noisy_copy(target, 0.4, seed=6), target


PROMPTS = [[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]]


# target-only, SVIP and a paper head go through the same loop in tests/decoders/test_exactness.py
@pytest.mark.parametrize("name", ["fixed_k1", "fixed_k4", "specdecpp_h0"])
def test_greedy_equals_target_greedy(pair32, name):
    draft, target = pair32
    decoder = SpeculativeDecoder(draft, target, policies(32)[name], SamplingConfig(temperature=0))
    accepted = 0
    for prompt, n in itertools.product(PROMPTS, (1, 5, 23)):
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=n, do_sample=False)
        out = decoder.generate(ids, max_new_tokens=n)
        assert out.tokens.tolist() == ref.tolist(), (prompt, n)
        assert out.stats.n_generated == n
        accepted += sum(out.stats.accept_lengths)
    assert accepted > 0  # rounds with accepted candidates were exercised


@pytest.mark.parametrize("name", ["fixed_k4", "svip", "specdecpp"])
def test_greedy_stops_at_eos_like_the_target(pair32, name):
    draft, target = pair32
    decoder = SpeculativeDecoder(draft, target, policies(32)[name], SamplingConfig(temperature=0))
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        free = target.generate(ids, max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
        eos = free[7]  # a token the target emits mid-way: generation must end at its first occurrence
        ref = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        out = decoder.generate(ids, max_new_tokens=20, eos_token_id=eos)
        assert out.tokens.tolist() == ref.tolist()
        assert out.tokens[0, -1].item() == eos and out.stats.n_generated == free.index(eos) + 1
        s = out.stats
        assert s.n_draft_calls + s.n_target_calls == s.n_generated + s.n_discarded


@pytest.fixture(scope="module")
def pair6():
    target = tiny_lm(5, 16, 2, seed=21, scale=0.8, heads=2)
    return noisy_copy(target, 0.25, seed=22), target


# fixed K = 3, the paper head and target-only at T = 1 on this pair, prompt and seed are the registry's
# chain-fixed_k3, chain-paper_head and chain-target_only cases in tests/decoders/test_exactness.py
# (a chi-square test samples 1,200 decodes: make test runs the top-p case, make test-full all)
DIST_CASES = [
    pytest.param("fixed_k3", SamplingConfig(temperature=0.8, top_k=3), marks=pytest.mark.slow),
    ("svip", SamplingConfig(temperature=1.0, top_p=0.9)),
    pytest.param("specdecpp", SamplingConfig(temperature=1.0, top_k=2), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,sampling", DIST_CASES)
def test_sampled_output_has_target_distribution(pair6, name, sampling):
    """The first 3 generated tokens, out of 4, follow the target's exact warped distribution.

    Generating 4 tokens lets the first round draft up to 3 candidates, so the policies' stop
    decisions vary inside the scored window (checked below) and rounds of every length count.
    """
    draft, target = pair6
    with torch.random.fork_rng():  # the same head whatever ran before
        torch.manual_seed(0)
        sharp_head = AcceptanceHead(16, 1)
    with torch.no_grad():  # logits spread over several units, centred: the stop point varies by context
        sharp_head.out.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
        # centre on e_1 (the state at y_1, after prompt [0, 1]), which decides stop-at-2 vs continue
        contexts = torch.tensor([[0, 1, a] for a in range(5)])
        hidden = draft(contexts, output_hidden_states=True).hidden_states[-1][:, -1]
        sharp_head.out.bias.sub_(sharp_head(hidden).median() + 0.1)
    policy = {"fixed_k3": FixedK(3), "svip": SVIP(threshold=0.33, max_candidates=4),
              "specdecpp": SpecDecPP(sharp_head, threshold=0.5, max_candidates=4),
              "target_only": TargetOnly()}[name]
    # prompt [0, 1]: SVIP never stops at the first candidate (sqrt(cH) = 0.25) and stops at the
    # second for some y_1 but not others (0.17 .. 0.42), so its K varies around threshold 0.33
    prompt, n_tokens, n_samples = [0, 1], 3, 1200
    expected = exact_distribution(target, prompt, n_tokens, sampling)
    decoder = SpeculativeDecoder(draft, target, policy, sampling)
    g = torch.Generator().manual_seed(1234)
    seqs, accepted, first_k = [], 0, set()
    for _ in range(n_samples):
        out = decoder.generate(torch.tensor([prompt]), max_new_tokens=n_tokens + 1, generator=g)
        seqs.append(tuple(out.tokens[0, len(prompt): len(prompt) + n_tokens].tolist()))
        accepted += sum(out.stats.accept_lengths)
        first_k.add(out.stats.candidate_lengths[0])
    assert chi_square_pvalue(seqs, expected) > 1e-4
    if name != "target_only":
        assert accepted > n_samples // 4  # the acceptance path is exercised, not only resampling
    if name in ("svip", "specdecpp"):
        assert len(first_k) >= 2, first_k  # the adaptive stop really varies


def test_distribution_test_rejects_a_lossy_sampler(pair6):
    """Negative control: sequences sampled from the draft alone fail the same test."""
    draft, target = pair6
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_distribution(target, [1, 3], 3, sampling)
    decoder = SpeculativeDecoder(target, draft, TargetOnly(), sampling)  # the draft alone, in the target's seat
    g = torch.Generator().manual_seed(7)
    seqs = [tuple(decoder.generate(torch.tensor([[1, 3]]), 3, generator=g).tokens[0, 2:].tolist())
            for _ in range(1200)]
    assert chi_square_pvalue(seqs, expected) < 1e-6


def test_same_generator_seed_gives_same_output(pair32):
    draft, target = pair32
    decoder = SpeculativeDecoder(draft, target, FixedK(3), SamplingConfig(temperature=1.0, top_k=10))
    runs = [decoder.generate(torch.tensor([[1, 2]]), 30, generator=torch.Generator().manual_seed(s))
            for s in (0, 0, 1)]
    assert runs[0].tokens.tolist() == runs[1].tokens.tolist()
    assert runs[0].stats.accept_lengths == runs[1].stats.accept_lengths
    assert runs[0].tokens.tolist() != runs[2].tokens.tolist()


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=1.0, top_k=10)], ids=["greedy", "T1", "top_k"])
@pytest.mark.parametrize("name", ["target_only", "fixed_k4", "svip"])
def test_each_commit_takes_the_drafts_the_rule_read(pair32, monkeypatch, name, sampling):
    """The exact rule reads the candidates with its verdict and the commit takes those values instead of
    reading the buffer back (on CUDA a synchronisation per round saved): every commit of a chain round gets
    them, they are what the buffer holds, and the output is what reading the buffer gives."""
    from specdecpp.decoders.rounds import TokenBuffer

    draft, target = pair32
    commit, given = TokenBuffer.commit, []

    def checked(self, n_accepted, token, drafted=None):
        given.append(drafted is not None and drafted[:n_accepted] == self.tokens[self.n : self.n + n_accepted].tolist())
        return commit(self, n_accepted, token, drafted)

    def unread(self, n_accepted, token, drafted=None):  # the buffer read back, as before
        return commit(self, n_accepted, token)

    outs = []
    for patched in (checked, unread):
        monkeypatch.setattr(TokenBuffer, "commit", patched)
        decoder = SpeculativeDecoder(draft, target, policies(32)[name], sampling)
        outs.append([decoder.generate(torch.tensor([p]), 24, torch.Generator().manual_seed(3), eos_token_id=5)
                     for p in PROMPTS])
    assert given and all(given)
    for a, b in zip(*outs, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.stats.accept_lengths == b.stats.accept_lengths


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)],
                         ids=["greedy", "T1"])
def test_each_batch_row_commits_the_drafts_its_rule_read(pair32, monkeypatch, sampling):
    """The batch runner hands each row's commit the drafts its rule read: every commit gets them, they are
    what the row's buffer holds, and the outputs are those of reading the buffers back."""
    from specdecpp.decoders.rounds import TokenBuffer

    draft, target = pair32
    commit, given = TokenBuffer.commit, []

    def checked(self, n_accepted, token, drafted=None):
        given.append(drafted is not None and drafted[:n_accepted] == self.tokens[self.n : self.n + n_accepted].tolist())
        return commit(self, n_accepted, token, drafted)

    def unread(self, n_accepted, token, drafted=None):
        return commit(self, n_accepted, token)

    outs = []
    for patched in (checked, unread):
        monkeypatch.setattr(TokenBuffer, "commit", patched)
        decoder = SpeculativeDecoder(draft, target, FixedK(3), sampling)
        outs.append(decoder.generate_batch([torch.tensor(p) for p in PROMPTS], 20, eos_token_id=5, batch_size=2,
                                           generators=[torch.Generator().manual_seed(s) for s in range(len(PROMPTS))]))
    assert given and all(given)
    for a, b in zip(*outs, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.stats.accept_lengths == b.stats.accept_lengths


def test_stats_are_consistent(pair32):
    draft, target = pair32
    decoder = SpeculativeDecoder(draft, target, FixedK(3), SamplingConfig(temperature=1.0))
    out = decoder.generate(torch.tensor([[2, 5]]), 50, generator=torch.Generator().manual_seed(0))
    s = out.stats
    assert s.n_generated == 50 == out.tokens.shape[1] - 2
    assert s.n_draft_calls + s.n_target_calls == s.n_generated + s.n_discarded  # Eq. 2.1 identity
    assert sum(s.accept_lengths) + len(s.accept_lengths) == s.n_generated
    assert s.n_target_calls == len(s.accept_lengths) and s.n_draft_calls == sum(s.candidate_lengths)
    assert all(k <= 3 for k in s.candidate_lengths)
    assert s.wall_time_s >= s.draft_time_s + s.target_time_s > 0


def test_specdecpp_stops_where_the_head_says():
    """Constant head s = sigmoid(a): stop at the first K with 1 - s^(K-1) > h (Algorithm 2)."""
    target = tiny_lm(16, 32, 1, seed=8)
    draft = copy.deepcopy(target)  # identical models: every candidate is accepted
    for logit, h in ((1.5, 0.3), (1.5, 0.95), (4.0, 0.95)):
        s = torch.sigmoid(torch.tensor(logit)).item()
        # independent of the policy code: first K with 1 - s^(K-1) > h, else the cap of 20
        expected_k = next((k for k in range(1, 21) if 1 - s ** (k - 1) > h), 20)
        policy = SpecDecPP(ConstantHead(32, logit), threshold=h, max_candidates=20)
        out = SpeculativeDecoder(draft, target, policy, SamplingConfig(temperature=0)).generate(
            torch.tensor([[1]]), 60)
        assert out.stats.candidate_lengths[0] == expected_k
        assert out.stats.accept_lengths[0] == expected_k


@pytest.mark.parametrize("bad,match", [
    (torch.zeros((1, 0), dtype=torch.long), "empty"),
    (torch.tensor([1, 2]), "shape"),
    (torch.tensor([[1], [2]]), "shape"),
])
def test_bad_prompts_are_refused(pair32, bad, match):
    decoder = SpeculativeDecoder(*pair32, FixedK(2), SamplingConfig())
    with pytest.raises(ValueError, match=match):
        decoder.generate(bad, 5)


@pytest.mark.parametrize("n", [0, -1, 2.5])
def test_bad_max_new_tokens_is_refused(pair32, n):
    decoder = SpeculativeDecoder(*pair32, FixedK(2), SamplingConfig())
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate(torch.tensor([[1]]), n)


def test_head_for_another_draft_is_refused(pair32):
    with pytest.raises(ValueError, match="hidden_size 48"):
        SpeculativeDecoder(*pair32, SpecDecPP(AcceptanceHead(48, 1)), SamplingConfig())


# -- hot loop: the draft computes only what the policy uses -------------------------------------
@pytest.mark.parametrize("name", ["fixed_k4", "svip", "specdecpp"])
def test_draft_runs_without_every_layers_states_and_hidden_only_for_the_head(pair32, name):
    draft, target = pair32
    policy = policies(32)[name]
    calls, handed = [], []
    hook = draft.register_forward_pre_hook(lambda m, a, kw: calls.append(kw.get("output_hidden_states")),
                                           with_kwargs=True)
    real = policy.should_stop
    policy.should_stop = lambda k, logits, hidden, token: handed.append(hidden) or real(k, logits, hidden, token)
    try:
        for sampling in (SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)):
            out = SpeculativeDecoder(draft, target, policy, sampling).generate(
                torch.tensor([[1, 2, 3]]), 12, generator=torch.Generator().manual_seed(0))
            assert out.stats.n_generated == 12
    finally:
        hook.remove()
    assert calls and not any(calls)  # never every layer's hidden states
    assert all((h is not None) == (name == "specdecpp") for h in handed)
    assert all(h.shape == (32,) for h in handed if h is not None)
    assert not draft.get_decoder()._forward_hooks  # the capture hook is gone after generate


def test_unsynced_clock_never_synchronises(monkeypatch):
    from specdecpp.core.timing import Clock

    syncs = []
    stream = type("Stream", (), {"synchronize": lambda self: syncs.append(1)})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    cuda = torch.device("cuda")
    marks = Clock(cuda, sync=False)
    marks.now()
    assert syncs == [] and not marks.exact
    exact = Clock(cuda)
    exact.now()
    assert syncs == [1] and exact.exact and Clock(torch.device("cpu"), sync=False).exact


def test_cpu_feed_pads_to_four_tokens_and_keeps_real_positions_exact(pair32):
    """scripts/bench_verify_cost.py: 2-3 tokens cost more than 4 on CPU; the runner pads them and
    crops the padding from the cache again, the real positions unchanged."""
    from specdecpp.models.runner import CPU_TOKEN_MULTIPLE, ModelRunner

    _, target = pair32
    assert CPU_TOKEN_MULTIPLE == 4
    seen = []
    hook = target.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("input_ids", a[0] if a else None)
                                                                         .shape[-1]), with_kwargs=True)
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    try:
        for n in (1, 2, 3, 4, 5):
            runner = ModelRunner(target, 32, want_hidden=True)
            with runner:
                runner.feed(ids[:4])
                seen.clear()
                logits, hidden = runner.feed(ids[4 : 4 + n], n_logits=n)
                assert seen == [n if n in (1, 4) else 4 if n < 4 else 8] and runner.length == 4 + n
                fresh = target(ids[None, : 4 + n], output_hidden_states=True)
                torch.testing.assert_close(logits, fresh.logits[0, -n:], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(hidden, fresh.hidden_states[-1][0, -n:], atol=1e-5, rtol=1e-5)
                after, _ = runner.feed(ids[4 + n : 5 + n])  # the cache holds the real tokens only
                torch.testing.assert_close(after, target(ids[None, : 5 + n]).logits[0, -1:], atol=1e-5, rtol=1e-5)
    finally:
        hook.remove()


@pytest.fixture
def kept_rows_on(monkeypatch):
    """The CPU's sparse rows (KeptProbs and verify_kept) for a tiny vocabulary: chunks of one
    logit and no least vocabulary; the verify_kept calls are counted."""
    import specdecpp.core.sampling as sampling
    import specdecpp.decoders.rounds as rounds

    monkeypatch.setattr(sampling, "TOP_K_MIN_VOCAB", 0)
    monkeypatch.setattr(sampling, "TOP_K_CHUNK", 1)
    calls = []
    monkeypatch.setattr(rounds, "verify_kept", lambda *a, f=rounds.verify_kept: calls.append(1) or f(*a))
    return calls


@pytest.mark.parametrize("name", ["fixed_k3", "specdecpp"])  # SVIP: the same-seed test below
def test_sampled_output_over_rows_kept_sparse_has_target_distribution(pair6, name, kept_rows_on):
    """Under top-k on a CPU the drafter keeps q sparse and the rule reads p sparse (verify_kept, the
    residual over the union of the kept tokens): the output still follows the target's distribution."""
    test_sampled_output_has_target_distribution(pair6, name, SamplingConfig(temperature=1.0, top_k=3))
    assert kept_rows_on


@pytest.mark.parametrize("decoder", ["fixed_k3", "svip", "pearl"])
def test_rows_kept_sparse_give_the_dense_rows_output_for_the_same_seed(pair32, decoder, monkeypatch):
    """Sparse rows change no token: the same seeds give the same tokens and rounds with them and with
    dense rows (chain decoders and PEARL, whose rounds go through the same rule)."""
    from specdecpp import PEARLDecoder

    draft, target = pair32
    sampling = SamplingConfig(temperature=1.0, top_k=10)

    def run():
        if decoder == "pearl":
            dec = PEARLDecoder(draft, target, gamma=3, sampling=sampling)
        else:
            dec = SpeculativeDecoder(draft, target, {"fixed_k3": FixedK(3), "svip": SVIP(0.4)}[decoder], sampling)
        outs = [dec.generate(torch.tensor([p]), 24, generator=torch.Generator().manual_seed(s))
                for s, p in enumerate(PROMPTS)]
        return [(o.tokens.tolist(), o.stats.accept_lengths) for o in outs]

    dense = run()
    import specdecpp.core.sampling as sampling_module
    import specdecpp.decoders.rounds as rounds

    monkeypatch.setattr(sampling_module, "TOP_K_MIN_VOCAB", 0)
    monkeypatch.setattr(sampling_module, "TOP_K_CHUNK", 2)
    calls = []
    monkeypatch.setattr(rounds, "verify_kept", lambda *a, f=rounds.verify_kept: calls.append(1) or f(*a))
    assert run() == dense and calls
