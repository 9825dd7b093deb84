"""The lag-free head (kind ``next``): lossless decoding, stopping at K = 1, its features (top-m,
position, optional ones), save/load and kind checks. The features the decoders hand it against
train's: tests/training/test_engine_features.py; its training: tests/apps/train/test_train_next_head.py;
the potential analysis: tests/analysis/test_potential_next_head.py."""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
import torch

from specdecpp import (
    AcceptanceHead,
    NextTokenHead,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
    load_head,
)
from specdecpp.models.loading import load_model
from specdecpp.stopping.head import NEXT_FEATURES, next_token_features
from tests.helpers.stats import chi_square_pvalue, exact_distribution
from tests.helpers.tiny import ConstantHead, ConstantNext, noisy_copy, random_next_head, tiny_lm


@pytest.fixture(scope="module")
def pair32():
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    return noisy_copy(target, 0.4, seed=6), target


# -- lossless ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0, 2])
def test_greedy_equals_target_greedy_with_the_lag_free_head(pair32, depth):
    draft, target = pair32
    policy = SpecDecPP(random_next_head(32, depth, seed=depth), threshold=0.5, max_candidates=5)
    decoder = SpeculativeDecoder(draft, target, policy, SamplingConfig(temperature=0))
    ks = set()
    for prompt, n in itertools.product([[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]], (1, 5, 23)):
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=n, do_sample=False)
        out = decoder.generate(ids, max_new_tokens=n)
        assert out.tokens.tolist() == ref.tolist(), (prompt, n)
        s = out.stats
        assert s.n_draft_calls + s.n_target_calls == s.n_generated + s.n_discarded
        ks.update(s.candidate_lengths)
    assert 1 in ks and max(ks) >= 2, ks  # rounds of one candidate and of several were exercised


@pytest.fixture(scope="module")
def pair6():
    target = tiny_lm(5, 16, 2, seed=21, scale=0.8, heads=2)
    return noisy_copy(target, 0.25, seed=22), target


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),  # top-k: make test-full
                                      pytest.param(SamplingConfig(temperature=1.0, top_k=2), marks=pytest.mark.slow)])
def test_sampled_output_has_target_distribution_with_the_lag_free_head(pair6, sampling):
    """As tests/decoders/test_chain.py for the other policies: the first 3 of 4 generated tokens follow the
    target's exact warped distribution, with a lag-free head whose stop after the first candidate
    depends on which y_1 was drafted."""
    draft, target = pair6
    head = random_next_head(16, 0, seed=3)
    prompt = [0, 1]
    with torch.no_grad():  # centre the logit over the 5 possible y_1: some stop at K = 1, some go on
        head.out.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
        head.attach(draft)
        out = draft(torch.tensor([prompt]), output_hidden_states=True)
        e0, logits = out.hidden_states[-1][0, -1], out.logits[0, -1]
        scores = torch.stack([head.score(e0, logits, torch.tensor(y)) for y in range(5)])
        head.out.bias.sub_(scores.median() + 0.05)
    policy = SpecDecPP(head, threshold=0.5, max_candidates=4)
    expected = exact_distribution(target, prompt, 3, sampling)
    decoder = SpeculativeDecoder(draft, target, policy, sampling)
    g = torch.Generator().manual_seed(99)
    seqs, first_k, accepted = [], set(), 0
    for _ in range(1200):
        out = decoder.generate(torch.tensor([prompt]), max_new_tokens=4, generator=g)
        seqs.append(tuple(out.tokens[0, 2:5].tolist()))
        first_k.add(out.stats.candidate_lengths[0])
        accepted += sum(out.stats.accept_lengths)
    assert chi_square_pvalue(seqs, expected) > 1e-4
    assert 1 in first_k and len(first_k) >= 2, first_k  # K = 1 for some y_1, more for others
    assert accepted > 300


# -- where it stops, and what it costs ---------------------------------------------------------------
class CountForwards:
    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_hook(self)

    def __call__(self, *args):
        self.n += 1


def test_a_head_forced_low_stops_every_round_at_one_candidate_and_wastes_no_draft_forward(pair32):
    draft, target = pair32
    counts = {}
    for kind, head in (("next", ConstantNext(32, -20.0)), ("resnet", ConstantHead(32, -20.0))):
        counter = CountForwards(draft)
        out = SpeculativeDecoder(draft, target, SpecDecPP(head, threshold=0.5, max_candidates=8),
                                 SamplingConfig(temperature=1.0)).generate(
            torch.tensor([[3, 1, 4]]), 40, generator=torch.Generator().manual_seed(1))
        counter.handle.remove()
        s = out.stats
        full = s.candidate_lengths[:-1]  # the last round may be cut by the length limit
        counts[kind] = (counter.n, s)
        if kind == "next":
            assert set(full) == {1}, s.candidate_lengths
            # every draft forward produced a candidate that the target then verified
            assert counter.n == s.n_draft_calls == sum(s.candidate_lengths)
        else:  # the paper's head must draft y_2 to judge y_1
            assert set(full) == {2}, s.candidate_lengths
    assert counts["next"][1].n_target_calls > counts["resnet"][1].n_target_calls  # shorter rounds


def test_lag_free_head_stops_where_the_rule_says():
    """Constant head s = sigmoid(a): the lag-free head stops at the first K with 1 - s^K > h (the
    paper's head at the first K with 1 - s^(K-1) > h)."""
    target = tiny_lm(16, 32, 1, seed=8)
    draft = copy.deepcopy(target)  # identical models: every candidate is accepted
    for logit, h in ((1.5, 0.3), (1.5, 0.95), (4.0, 0.95), (0.0, 0.4)):
        s = torch.sigmoid(torch.tensor(logit)).item()
        expected_k = next((k for k in range(1, 21) if 1 - s ** k > h), 20)
        policy = SpecDecPP(ConstantNext(32, logit), threshold=h, max_candidates=20)
        out = SpeculativeDecoder(draft, target, policy, SamplingConfig(temperature=0)).generate(torch.tensor([[1]]), 60)
        assert out.stats.candidate_lengths[0] == expected_k == out.stats.accept_lengths[0]


def test_topm_feature_is_the_sorted_top_probabilities_of_q():
    """``topm``: the m largest probabilities of softmax(logits / T), largest first, recomputed
    here with numpy from the logits."""
    g = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(6, 8, generator=g), 3 * torch.randn(6, 40, generator=g)
    tokens = torch.randint(0, 40, (6,), generator=g)
    got = next_token_features(hidden, logits, tokens, None, 0.7, ("topm", "prob"), top_m=4)
    z = logits.double().numpy() / 0.7
    q = np.exp(z - z.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    expected = -np.sort(-q, axis=-1)[:, :4]
    np.testing.assert_allclose(got[:, :4].numpy(), expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got[:, 4].numpy(), q[np.arange(6), tokens.numpy()], rtol=1e-5, atol=1e-7)
    assert (got[:, 0] >= got[:, 4] - 1e-7).all()  # the chosen token is never above the top one


def test_position_feature_is_log1p_of_the_response_index_and_needs_positions():
    g = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(3, 8, generator=g), torch.randn(3, 40, generator=g)
    tokens = torch.tensor([4, 0, 39])
    got = next_token_features(hidden, logits, tokens, None, 1.0, ("prob", "position"),
                              positions=torch.tensor([0, 1, 99]))
    np.testing.assert_allclose(got[:, 1].numpy(), np.log([1.0, 2.0, 100.0]), rtol=1e-6)
    with pytest.raises(ValueError, match="position.*needs each candidate's index"):
        next_token_features(hidden, logits, tokens, None, 1.0, ("position",))
    with pytest.raises(ValueError, match="must have the candidates' shape"):
        next_token_features(hidden, logits, tokens, None, 1.0, ("position",), positions=torch.tensor([1, 2]))
    head = NextTokenHead(8, 0, features=("prob", "position"))
    assert head.needs_position and head.feature_size == 2 and not NextTokenHead(8).needs_position
    policy = SpecDecPP(head, threshold=0.5)
    with pytest.raises(RuntimeError, match="did not say where the round starts"):
        policy.should_stop(1, logits[0], hidden[0], tokens[0])  # no begin_round: the position is unknown
    policy.begin_round(7)
    x = next_token_features(hidden[:1], logits[:1], tokens[:1], None, 1.0, ("prob", "position"),
                            positions=torch.tensor([8]))  # the round's second candidate: index 7 + 1
    policy.should_stop(1, logits[0], hidden[0], tokens[0])
    p2 = torch.sigmoid(head(x)).double()
    stop = policy.should_stop(2, logits[0], hidden[0], tokens[0])
    p1 = torch.sigmoid(head(next_token_features(hidden[:1], logits[:1], tokens[:1], None, 1.0, ("prob", "position"),
                                                positions=torch.tensor([7])))).double()
    assert policy._p_one == pytest.approx(float(p1 * p2), rel=1e-12)  # scored at indices 7 and 8
    assert stop == bool(1 - p1 * p2 > 0.5)


def test_optional_features_round_trip_and_old_configs_load_with_todays_features(tmp_path):
    head = NextTokenHead(16, 1, features=("prob", "entropy", "topm"), top_m=3, temperature=0.8)
    assert head.feature_size == 1 + 1 + 3 and head.feature_spec()["top_m"] == 3
    head.save_pretrained(tmp_path / "h")
    loaded = load_head(tmp_path / "h")
    assert loaded.features == ("prob", "entropy", "topm") and loaded.top_m == 3 and loaded.feature_size == 5
    x = torch.randn(2, 5)
    torch.testing.assert_close(loaded(x), head(x))
    # a head saved before optional features existed: no top_m in its config, today's five features
    default = NextTokenHead(16, 1)
    assert "top_m" not in default.feature_spec()
    default.save_pretrained(tmp_path / "old")
    cfg = json.loads((tmp_path / "old" / "config.json").read_text())
    assert "top_m" not in cfg and cfg["features"] == list(NEXT_FEATURES)
    del cfg["features"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    assert load_head(tmp_path / "old").features == NEXT_FEATURES
    with pytest.raises(ValueError, match="top_m"):
        NextTokenHead(16, 1, features=("topm",), top_m=0)
    with pytest.raises(ValueError, match="topm"):
        NextTokenHead(16, 1, features=("hidden", "nonsense"))


# -- persistence and kinds ----------------------------------------------------------------------------
def test_save_load_round_trip_and_kind_checks(tmp_path, tiny_pair):
    head = random_next_head(32, 2, seed=0)
    head.features, head.temperature = tuple(NEXT_FEATURES), 0.7
    head.save_pretrained(tmp_path / "next")
    loaded = load_head(tmp_path / "next")
    assert isinstance(loaded, NextTokenHead) and loaded.kind == "next" and loaded.temperature == 0.7
    x = torch.randn(4, head.feature_size)
    torch.testing.assert_close(loaded(x), head(x))
    assert json.loads((tmp_path / "next" / "config.json").read_text())["kind"] == "next"
    resnet = AcceptanceHead(32, 1)
    resnet.save_pretrained(tmp_path / "resnet")
    assert type(load_head(tmp_path / "resnet")) is AcceptanceHead
    with pytest.raises(ValueError, match="kind 'next', not 'resnet'.*load_head"):
        AcceptanceHead.from_pretrained(tmp_path / "next")
    with pytest.raises(ValueError, match="kind 'resnet', not 'next'"):
        NextTokenHead.from_pretrained(tmp_path / "resnet")
    wrong = NextTokenHead(48, 1)
    with pytest.raises(ValueError, match="hidden_size 48"):
        SpecDecPP(wrong).bind(load_model(tiny_pair.draft, "cpu"), 1.0)
    with pytest.raises(ValueError, match="features"):
        NextTokenHead(32, features=("hidden", "nonsense"))
    with pytest.raises(ValueError, match="expects 67 features"):
        head(torch.randn(2, 32))


