"""The lag-free head (kind ``next``): lossless decoding, stopping at K = 1, the features the engine
hands it equal train's, training, save/load and kind checks, the potential analysis."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset

from specdecpp import (
    AcceptanceHead,
    NextTokenHead,
    PEARLDecoder,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
    load_head,
    load_pair,
)
from specdecpp.analysis import potential as pt
from specdecpp.models.loading import load_model
from specdecpp.stopping.head import ALL_NEXT_FEATURES, NEXT_FEATURES, next_token_features
from specdecpp.training.mixing import lag_free_features, mixed_features, mixing_mask
from tests.helpers.paths import CONF
from tests.helpers.stats import chi_square_pvalue, exact_distribution
from tests.helpers.tiny import ConstantHead, noisy_copy, tiny_lm
from tests.helpers.train import base_overrides, random_rows, save_dataset, train_cfg
from train import run
from train.cache import feature_cache


class ConstantNext(NextTokenHead):
    """A lag-free head predicting the same acceptance logit everywhere."""

    def __init__(self, hidden_size, logit):
        super().__init__(hidden_size, depth=0)
        with torch.no_grad():
            self.out.weight.zero_()
            self.out.bias.fill_(logit)


@pytest.fixture(scope="module")
def pair32():
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    return noisy_copy(target, 0.4, seed=6), target


def random_next_head(hidden: int, depth: int, seed: int) -> NextTokenHead:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return NextTokenHead(hidden, depth)


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


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0, top_k=2)])
def test_sampled_output_has_target_distribution_with_the_lag_free_head(pair6, sampling):
    """As tests/test_engine.py for the other policies: the first 3 of 4 generated tokens follow the
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


@pytest.mark.parametrize("features, top_m", [(NEXT_FEATURES, None), (ALL_NEXT_FEATURES, 5)],
                         ids=["default", "every-feature"])
def test_engine_hands_the_lag_free_head_the_features_train_computes(tiny_pair, tmp_path, features, top_m):
    """A spy head records the features the engine builds for every candidate; for each candidate
    that was committed, train's features of the generated sequence (raw rows, the feature cache
    and the target context) hold the same vector at the same position. Every feature a head can ask for is covered
    (``every-feature``: the optional ones too)."""
    draft, target, _ = load_pair(tiny_pair.draft, tiny_pair.target, device="cpu")

    class Spy(NextTokenHead):
        def __init__(self):
            super().__init__(32, depth=1, features=features, **({"top_m": top_m} if top_m else {}))
            self.calls = []

        def score(self, hidden, logits, token, positions=None):
            feats = self.features_of(hidden, logits, token, positions=positions)
            self.calls.append((int(token), feats.detach().reshape(-1).clone()))  # one row (a batch of 1)
            return torch.full(token.shape, 2.0)  # sigmoid(2) = 0.88: rounds of a few candidates

    class Recorder(SpecDecPP):
        def new_round(self):
            super().new_round()
            self.head.calls = []
            self.rounds.append(self.head.calls)

    spy = Spy()
    policy = Recorder(spy, threshold=0.6, max_candidates=6)
    policy.rounds = []
    prompt = [5, 9, 13, 2, 7]
    out = SpeculativeDecoder(draft, target, policy, SamplingConfig(temperature=1.0)).generate(
        torch.tensor([prompt]), max_new_tokens=40, generator=torch.Generator().manual_seed(3))
    response = out.tokens[0, len(prompt):].tolist()
    row = {"row": 0, "prompt_ids": torch.tensor(prompt), "target_ids": torch.tensor(response),
           "draft_ids": torch.tensor(response), "p_acc": torch.ones(len(response))}
    spec = spy.feature_spec()
    (raw,), _ = mixed_features(draft, [row], ratio=0.0, seed=0, spec=spec)  # every position is a Y-position
    split = Dataset.from_dict({"prompt_ids": [prompt], "target_ids": [response], "draft_ids": [response],
                               "p_acc": [[1.0] * len(response)]})
    cached, _ = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.0, 0, spec=spec,
                              feature_size=spy.feature_size).row(0)
    (in_target_context,), _ = mixed_features(draft, [row], ratio=0.15, seed=0, spec={**spec, "context": "target"})
    width = 2 * 32 + 3 + (top_m + 1 if top_m else 0)  # every feature: topm (top_m) and position (1) too
    assert raw.shape == cached.shape == in_target_context.shape == (len(response), width) and spy.feature_size == width

    checked, n = {"k=1": 0, "k>=2": 0}, len(prompt)
    for calls, accepted in zip(policy.rounds, out.stats.accept_lengths, strict=True):
        for k, (token, feats) in enumerate(calls, start=1):
            if k > accepted:
                continue  # a rejected candidate: not in the final sequence
            j = n + k - 1 - len(prompt)  # the response index of y_k
            assert response[j] == token
            torch.testing.assert_close(feats, raw[j], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(feats, cached[j], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(feats, in_target_context[j], atol=1e-4, rtol=1e-4)  # data.feature_context=target
            checked["k=1" if k == 1 else "k>=2"] += 1
        n += accepted + 1
    assert n == out.tokens.shape[1] and checked["k=1"] >= 5 and checked["k>=2"] >= 5, checked


@pytest.mark.parametrize("fill", [False, True], ids=["per-row", "fill"])
def test_batch_engine_hands_the_lag_free_head_the_features_train_computes(tiny_pair, monkeypatch, fill):
    """generate_batch scores every row's candidates at once: each row's committed candidates get the
    features train computes from that row's output, the position feature included (each row at its
    own index in its own response, rows leaving the batch as they finish)."""
    import specdecpp.decoders.batch as batch_mod

    draft, target, _ = load_pair(tiny_pair.draft, tiny_pair.target, device="cpu")
    features = ALL_NEXT_FEATURES

    class Spy(NextTokenHead):
        def __init__(self):
            super().__init__(32, depth=1, features=features, top_m=5)

        def score(self, hidden, logits, token, positions=None):
            feats = self.features_of(hidden, logits, token, positions=positions)
            self.round.append((self.k, self.active.clone(), token.clone(), feats.detach().clone()))
            return torch.full(token.shape, 2.0)

    live = {}
    original = batch_mod.BatchDrafter.block

    def block(self, seqs, counts, gens):
        live["seqs"] = list(seqs)  # which prompts the round's rows are, and their committed response lengths
        live["starts"] = [s.n - s.prompt_len for s in seqs]
        return original(self, seqs, counts, gens)

    monkeypatch.setattr(batch_mod.BatchDrafter, "block", block)

    class Recorder(SpecDecPP):
        def new_round(self):
            super().new_round()
            self.head.round = []
            self.rounds.append((live["seqs"], live["starts"], self.head.round))

        def stop_rows(self, k, logits, hidden, tokens, active):
            self.head.k, self.head.active = k, active
            return super().stop_rows(k, logits, hidden, tokens, active)

    spy = Spy()
    policy = Recorder(spy, threshold=0.6, max_candidates=6)
    policy.rounds = []
    prompts = [[5, 9, 13, 2, 7], [3, 1], [8, 8, 4, 6, 10, 12, 1], [2, 11, 7]]
    gens = [torch.Generator().manual_seed(10 + j) for j in range(len(prompts))]
    outs = SpeculativeDecoder(draft, target, policy, SamplingConfig(temperature=1.0)).generate_batch(
        [torch.tensor(p) for p in prompts], max_new_tokens=30, generators=gens, batch_size=3,
        fill=fill)
    responses = {tuple(p): o.tokens[0, len(p):].tolist() for p, o in zip(prompts, outs, strict=True)}
    spec = spy.feature_spec()
    train_features = {}
    for p, resp in responses.items():
        row = {"row": 0, "prompt_ids": torch.tensor(p), "target_ids": torch.tensor(resp),
               "draft_ids": torch.tensor(resp), "p_acc": torch.ones(len(resp))}
        (train_features[p],), _ = mixed_features(draft, [row], ratio=0.0, seed=0, spec=spec)
    checked = 0
    for seqs, starts, calls in policy.rounds:
        for b, s in enumerate(seqs):
            p = tuple(s.tokens[: s.prompt_len].tolist())
            resp = responses[p]
            for k, active, tokens, feats in calls:  # k = 1, 2, ...: y_k of every row
                if not active[b]:
                    break  # the row stopped drafting (fill: it drafts on, but the test reads the policy's rows)
                j = starts[b] + k - 1  # y_k's index in the row's response
                if j >= len(resp) or resp[j] != int(tokens[b]):
                    break  # rejected (a rejected candidate never equals what replaces it): the rest is discarded
                torch.testing.assert_close(feats[b], train_features[p][j], atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked >= 20, checked


def test_pearl_hands_the_lag_free_head_the_features_train_computes(tiny_pair):
    """PEARL drafts its next block while the target verifies, from a start that already holds the
    pending drafts: its candidates' features, the position included, equal train's at their index."""
    draft, target, _ = load_pair(tiny_pair.draft, tiny_pair.target, device="cpu")

    class Spy(NextTokenHead):
        def __init__(self):
            super().__init__(32, depth=1, features=ALL_NEXT_FEATURES, top_m=5)

        def score(self, hidden, logits, token, positions=None):
            feats = self.features_of(hidden, logits, token, positions=positions)
            self.round.append((int(token), feats.detach().reshape(-1).clone()))
            return torch.full(token.shape, 2.0)

    class Recorder(SpecDecPP):
        def new_round(self):
            super().new_round()
            self.head.round = []
            self.rounds.append((self.generated, self.head.round))

    policy = Recorder(Spy(), threshold=0.6, max_candidates=6)
    policy.rounds = []
    prompt = [5, 9, 13, 2, 7]
    out = PEARLDecoder(draft, target, 3, SamplingConfig(temperature=1.0), policy=policy).generate(
        torch.tensor([prompt]), max_new_tokens=40, generator=torch.Generator().manual_seed(4))
    response = out.tokens[0, len(prompt):].tolist()
    row = {"row": 0, "prompt_ids": torch.tensor(prompt), "target_ids": torch.tensor(response),
           "draft_ids": torch.tensor(response), "p_acc": torch.ones(len(response))}
    (train_features,), _ = mixed_features(draft, [row], ratio=0.0, seed=0, spec=policy.head.feature_spec())
    checked = 0
    for generated, calls in policy.rounds:
        for k, (token, feats) in enumerate(calls, start=1):
            j = generated + k - 1
            if j >= len(response) or response[j] != token:
                break  # rejected: this candidate and the rest of its block were discarded
            torch.testing.assert_close(feats, train_features[j], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 10, checked


def test_train_features_use_the_draft_logits_of_a_full_forward(tiny_pair):
    """lag_free_features recomputes q from the hidden state by the output layer: it must equal the
    q of the draft's own forward at the same position."""
    draft = load_model(tiny_pair.draft, "cpu")
    ids = torch.tensor([[5, 9, 13, 2, 7, 11, 4]])
    with torch.no_grad():
        out = draft(ids, output_hidden_states=True)
    hidden, tokens = out.hidden_states[-1][0, :-1], ids[0, 1:]
    spec = NextTokenHead(32).feature_spec()
    expected = next_token_features(hidden, out.logits[0, :-1], tokens, draft.get_input_embeddings(), 1.0)
    torch.testing.assert_close(lag_free_features(draft, hidden, tokens, spec), expected)
    q = torch.softmax(out.logits[0, :-1], -1).gather(-1, tokens[:, None])
    torch.testing.assert_close(expected[:, 64:65], q)  # hidden (32) + embedding (32), then prob


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
    got = next_token_features(hidden, logits, tokens, None, 1.0, ("prob", "position"), positions=torch.tensor([0, 1, 99]))
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
    torch.testing.assert_close(policy._p_all_accepted, (p1 * p2).reshape(1))  # scored at indices 7 and 8
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


# -- training -----------------------------------------------------------------------------------------
def test_train_head_next_learns_labels_that_depend_on_q(tiny_pair, tmp_path):
    """``head=next``: labels P_i = sigmoid(3 z(log q(Y_i | Z_<i))) under the fixed mixing, which the
    lag-free head sees as a feature and the paper's head (state at Y_i) does not; the trained head
    ranks them well and saves its kind."""
    draft = load_model(tiny_pair.draft, "cpu")
    splits = {"train": random_rows(48, tiny_pair.vocab, 21), "dev": random_rows(16, tiny_pair.vocab, 22)}
    spec = NextTokenHead(32).feature_spec()
    for rows in splits.values():
        batch = [{"row": j, **{c: torch.tensor(rows[c][j]) for c in ("prompt_ids", "target_ids", "draft_ids", "p_acc")}}
                 for j in range(len(rows["id"]))]
        feats, _ = mixed_features(draft, batch, 0.15, 0, 0, spec)
        logq = torch.cat(feats)[:, 65]  # hidden (32), embedding (32), prob, logprob, entropy
        mean, std = logq.mean(), logq.std()
        for j, f in enumerate(feats):
            keep = (~mixing_mask(len(rows["target_ids"][j]), 0.15, 0, 0, j)).nonzero().squeeze(-1)
            labels = torch.tensor(rows["p_acc"][j])
            labels[keep] = torch.sigmoid(3.0 * (f[:, 65] - mean) / std)
            rows["p_acc"][j] = labels.tolist()
    data = save_dataset(tmp_path / "data", splits, tiny_pair.draft, 32, tiny_pair.vocab)
    cfg = train_cfg([*base_overrides(tiny_pair, data, tmp_path, "callbacks=none", "trainer=cpu"),
                     "head=next", "+experiment=wrej1_d1", "trainer.max_epochs=20", "data.batch_size=8",
                     "optimizer.lr=0.01"])
    assert cfg.experiment_name == "next_wrej1_d1"
    result = run(cfg)
    assert result["metrics"]["dev"]["AUROC"] > 0.8, result["metrics"]["dev"]
    assert result["metrics"]["dev"]["KL"] < 0.5 * result["metrics"]["dev"]["KL_const"]
    head = load_head(cfg.out)
    assert isinstance(head, NextTokenHead) and head.depth == 1 and head.temperature == 1.0
    assert json.loads((Path(cfg.out) / "config.json").read_text())["training"]["head_kind"] == "next"


def test_target_context_features_are_the_states_that_drew_each_candidate(tiny_pair, tmp_path):
    """``data.feature_context=target``: position i's feature comes from the draft's own forward
    over x, X_<i (recomputed here one prefix at a time) and the candidate Y_i, every position
    carries a loss, raw and cached features agree, and the paper's head is refused."""
    draft = load_model(tiny_pair.draft, "cpu")
    rows = random_rows(3, tiny_pair.vocab, 5)
    batch = [{"row": j, **{c: torch.tensor(rows[c][j]) for c in ("prompt_ids", "target_ids", "draft_ids", "p_acc")}}
             for j in range(3)]
    spec = {**NextTokenHead(32, features=ALL_NEXT_FEATURES, top_m=4).feature_spec(), "context": "target"}
    feats, labels = mixed_features(draft, batch, 0.15, 0, 0, spec)
    emb = draft.get_input_embeddings()
    for r, f, lab in zip(batch, feats, labels, strict=True):
        n = len(r["target_ids"])
        assert f.shape[0] == n and torch.equal(lab, r["p_acc"].float())
        for i in range(n):
            ids = torch.cat([r["prompt_ids"], r["target_ids"][:i]])[None]
            with torch.no_grad():
                out = draft(ids, output_hidden_states=True)
            expected = next_token_features(out.hidden_states[-1][0, -1], out.logits[0, -1], r["draft_ids"][i], emb,
                                           1.0, ALL_NEXT_FEATURES, top_m=4, positions=torch.tensor(i))
            torch.testing.assert_close(f[i], expected, atol=1e-4, rtol=1e-4)
    split = Dataset.from_dict({c: rows[c] for c in ("prompt_ids", "target_ids", "draft_ids", "p_acc")})
    cache = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.15, 0, spec=spec,
                          feature_size=f.shape[1])
    for j in range(3):
        cached, cached_labels = cache.row(j)
        torch.testing.assert_close(cached, feats[j], atol=1e-5, rtol=1e-5)
        assert torch.equal(cached_labels, labels[j])
    with pytest.raises(ValueError, match="feature_context=target needs the lag-free head"):
        mixed_features(draft, batch, 0.15, 0, 0, {"kind": "resnet", "context": "target"})
    with pytest.raises(ValueError, match="feature_context must be one of"):
        mixed_features(draft, batch, 0.15, 0, 0, {**spec, "context": "nonsense"})


def test_train_in_the_target_context_records_it_and_refuses_the_paper_head(tiny_pair, tmp_path):
    draft = load_model(tiny_pair.draft, "cpu")
    splits = {"train": random_rows(24, tiny_pair.vocab, 31), "dev": random_rows(8, tiny_pair.vocab, 32)}
    data = save_dataset(tmp_path / "data", splits, tiny_pair.draft, 32, tiny_pair.vocab)
    common = [*base_overrides(tiny_pair, data, tmp_path, "callbacks=none", "trainer=cpu"), "trainer.max_epochs=1",
              "data.feature_context=target"]
    with pytest.raises(ValueError, match="needs the lag-free head"):
        run(train_cfg([*common, "+experiment=wrej1_d1"]))
    result = run(train_cfg([*common, "head=next", "+experiment=wrej1_d1"]))
    config = json.loads((Path(result["out"]) / "config.json").read_text())
    assert config["training"]["feature_context"] == "target"
    n_tokens = sum(len(t) for t in splits["dev"]["target_ids"])
    assert result["metrics"]["dev"]["positions"] == n_tokens  # every position, not only the mixing's Y-positions
    del draft


# -- the potential analysis -----------------------------------------------------------------------------
def test_potential_scores_lag_free_heads_in_the_target_context(tiny_pair, tmp_path):
    """``infer.potential --head-context target``: a lag-free head's P_hat at position i is the head
    applied to the features of the draft's forward over x, X_<i (recomputed prefix by prefix)."""
    from infer.potential import heads_predictions

    draft = load_model(tiny_pair.draft, "cpu")
    head = random_next_head(32, 1, seed=4)
    head.save_pretrained(tmp_path / "h")
    rows = random_rows(2, tiny_pair.vocab, 9)
    raw = [{"row": j, **{c: rows[c][j] for c in ("prompt_ids", "target_ids", "draft_ids", "p_acc")}} for j in range(2)]
    (preds,) = heads_predictions([str(tmp_path / "h")], raw, {"draft": tiny_pair.draft}, context="target")
    head.attach(draft)
    for r, p in zip(raw, preds, strict=True):
        for i in range(len(r["target_ids"])):
            with torch.no_grad():
                out = draft(torch.tensor([r["prompt_ids"] + r["target_ids"][:i]]), output_hidden_states=True)
                expected = torch.sigmoid(head.score(out.hidden_states[-1][0, -1], out.logits[0, -1],
                                                    torch.tensor(r["draft_ids"][i])))
            assert abs(p[i] - float(expected)) < 1e-4
    with pytest.raises(ValueError, match="head-context"):
        heads_predictions([str(tmp_path / "h")], raw, {"draft": tiny_pair.draft}, context="elsewhere")



def test_potential_head_rule_with_lag_zero_is_the_lag_free_rule():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(6):
        p = rng.random(40)
        rows.append({"p_acc": p, "draft_entropy": rng.random(40), "pred:free": p.copy(), "pred:paper": p.copy()})
    pols = [pt.informed_lag_free(0.4), pt.head_rule("free", 0.4, lag=0), pt.informed(0.4), pt.head_rule("paper", 0.4)]
    res = pt.simulate(rows, pols, seeds=range(3))
    records = pt.summarise(res, pols, pt.Costs.from_ratio(0.1), n_boot=50)
    vals = [(r["verification_rate"], r["discard_rate"]) for r in records]
    assert vals[0] == pytest.approx(vals[1]) and vals[2] == pytest.approx(vals[3])
    assert vals[0][0] != pytest.approx(vals[2][0])  # the lag changes the rounds


# -- infer: both kinds side by side ---------------------------------------------------------------------
def test_infer_sweep_runs_both_head_kinds_side_by_side(tiny_pair, tmp_path):
    """``infer.sweep`` with a paper head and a lag-free head: greedy output equal to target-only for
    both, rows record the kind, the lag-free head's rounds may have one candidate, the report names
    both."""
    from hydra import compose, initialize_config_dir

    from infer import sweep
    from infer.report import build_report
    from infer.results import read_rows

    conf = CONF
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n'
                       '{"id": "math", "prompt": "What is 12 times 7?"}\n')
    AcceptanceHead(32, 1, draft=tiny_pair.draft).save_pretrained(tmp_path / "paper")
    ConstantNext(32, -20.0).save_pretrained(tmp_path / "free")  # forced low: one candidate per round
    cfg_file = tmp_path / "free" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["draft"] = tiny_pair.draft
    cfg_file.write_text(json.dumps(cfg))
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("infer", overrides=[
            f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "prompts=jsonl",
            f"prompts.path={prompts}", "max_new_tokens=8", "warmup_tokens=0", "progress=false", "sampling=greedy",
            f"out={tmp_path}/res/${{method.name}}", "~comparison.svip", "~comparison.hf_assisted", "~comparison.oracle",
            "~comparison.fixed_k", "~comparison.specdecpp",
            f"+comparison.specdecpp=[{{head:{tmp_path / 'paper'},threshold:0.5}},{{head:{tmp_path / 'free'},threshold:0.5}}]"])
    summaries = sweep.run(cfg)
    rows = {s["method"] + ":" + Path(s["path"]).name: read_rows(Path(s["path"])) for s in summaries}
    reference = next(r for k, r in rows.items() if k.startswith("target_only"))
    kinds = {}
    for key, rs in rows.items():
        assert [r["output_ids"] for r in rs] == [r["output_ids"] for r in reference], key
        if key.startswith("specdecpp"):
            kinds[rs[0]["settings"]["head_kind"]] = rs
    assert set(kinds) == {"resnet", "next"}
    assert all(set(r["candidate_lengths"][:-1]) <= {1} for r in kinds["next"])
    assert any(max(r["candidate_lengths"]) >= 2 for r in kinds["resnet"])
    build_report(tmp_path / "res", tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "free_h0.5" in text and "paper_h0.5" in text


def test_potential_tells_heads_of_the_same_name_apart(tmp_path):
    from infer.potential import head_labels

    a, b, c = tmp_path / "x" / "next_wrej1_d1", tmp_path / "y" / "next_wrej1_d1", tmp_path / "y" / "wrej1_d0"
    assert head_labels([a, b, c]) == ["x/next_wrej1_d1", "y/next_wrej1_d1", "wrej1_d0"]
    assert head_labels([c]) == ["wrej1_d0"]
    with pytest.raises(ValueError, match="twice"):
        head_labels([a, a])
