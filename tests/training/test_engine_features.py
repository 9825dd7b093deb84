"""The features a decoder hands a stop head equal the ones train learns from (raw rows and the feature
cache), for the paper's head here and for the lag-free head in every decoder."""

from __future__ import annotations

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
    load_pair,
)
from specdecpp.models.loading import load_model
from specdecpp.stopping.head import ALL_NEXT_FEATURES, NEXT_FEATURES, next_token_features
from specdecpp.training.mixing import lag_free_features, mixed_features
from train.cache import feature_cache


def test_engine_hands_the_head_the_features_train_learns_from(tiny_pair, tmp_path):
    """End to end: the engine runs with a spy policy that records every hidden state it is handed;
    for each one that sits on a committed token, train's features for the generated sequence (raw
    rows and the feature cache) hold the same vector at the same position."""
    from specdecpp import SamplingConfig, SpeculativeDecoder, StopPolicy, load_pair
    from specdecpp.data.prompts import encode_prompt

    class Spy(StopPolicy):
        name, max_candidates, needs_hidden = "spy", 4, True

        def __init__(self):
            self.rounds = []

        def begin_round(self, generated=None):
            self.rounds.append([])

        def should_stop(self, k, logits, hidden, token=None):
            self.rounds[-1].append((k, hidden.detach().clone()))
            return k >= self.max_candidates

    draft, target, tok = load_pair(tiny_pair.draft, tiny_pair.target, device="cpu")
    prompt = encode_prompt(tok, "Write a short poem about the sea.")
    spy = Spy()
    out = SpeculativeDecoder(draft, target, spy, SamplingConfig(temperature=1.0)).generate(
        torch.tensor([prompt]), max_new_tokens=40, generator=torch.Generator().manual_seed(3))
    response = out.tokens[0, len(prompt):].tolist()
    row = {"row": 0, "prompt_ids": torch.tensor(prompt), "target_ids": torch.tensor(response),
           "draft_ids": torch.tensor(response), "p_acc": torch.ones(len(response))}
    (raw,), _ = mixed_features(draft, [row], ratio=0.0, seed=0)  # every position is a Y-position
    split = Dataset.from_dict({"prompt_ids": [prompt], "target_ids": [response], "draft_ids": [response],
                               "p_acc": [[1.0] * len(response)]})
    cached, _ = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.0, 0).row(0)
    assert raw.shape == cached.shape == (len(response), 32)

    checked, n = {"k=1": 0, "k>=2": 0}, len(prompt)  # n: committed tokens at the start of the round
    for calls, accepted in zip(spy.rounds, out.stats.accept_lengths, strict=True):
        for k, hidden in calls:
            index = n + k - 2  # the state at y_{k-1} (at the last committed token when k == 1)
            if k - 1 > accepted or index < len(prompt):
                continue  # a rejected candidate, or a prompt token: no training position
            j = index - len(prompt)  # train: feature of response token j + 1 sits at len(prompt) + j
            torch.testing.assert_close(hidden, raw[j], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden, cached[j], atol=1e-4, rtol=1e-4)
            assert not torch.allclose(hidden, raw[j - 1], atol=1e-3) if j > 0 else True
            checked["k=1" if k == 1 else "k>=2"] += 1
        n += accepted + 1
    assert n == out.tokens.shape[1] and checked["k=1"] >= 5 and checked["k>=2"] >= 5, checked


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
        def begin_round(self, generated=None):
            super().begin_round(generated)
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

    def block(self, seqs, counts, gens, *rest):
        live["seqs"] = list(seqs)  # which prompts the round's rows are, and their committed response lengths
        live["starts"] = [s.n - s.prompt_len for s in seqs]
        return original(self, seqs, counts, gens, *rest)

    monkeypatch.setattr(batch_mod.BatchDrafter, "block", block)

    class Recorder(SpecDecPP):
        def begin_round(self, generated=None):
            super().begin_round(generated)
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
        def begin_round(self, generated=None):
            super().begin_round(generated)
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


@pytest.mark.parametrize("kind", ["next", "resnet"])
def test_engine_hands_a_feature_drafts_head_the_features_train_computes(tiny_pair, kind):
    """A feature draft (EAGLE-3): a spy head records the features the chain builds for every candidate
    (the lag-free head, ``next``: from the state that drew it, its logits and the candidate; the paper's head,
    ``resnet``, one candidate of lag: the draft's state after feeding it); for each committed candidate
    drafted as its round's k-th, train's features of the generated sequence at (its position, depth k)
    (feature_draft_head_features, the labels' own context) are the same vector. Candidates at depths 1 and
    >= 2 both occur."""
    from specdecpp.training.mixing import feature_draft_head_features
    from tests.helpers.tiny import perturbed_feature_draft

    _, target, _ = load_pair(tiny_pair.draft, tiny_pair.target, device="cpu")
    draft = perturbed_feature_draft(target)
    depths = 6
    base = NextTokenHead if kind == "next" else AcceptanceHead
    extra = {"features": ALL_NEXT_FEATURES, "top_m": 5} if kind == "next" else {}

    class Spy(base):
        def __init__(self):
            super().__init__(target.config.hidden_size, depth=1, **extra)
            self.calls = []

        def score(self, hidden, logits, token, positions=None):
            feats = self.features_of(hidden, logits, token, positions=positions) if kind == "next" else hidden
            self.calls.append((int(token) if kind == "next" else None, feats.detach().reshape(-1).clone()))
            return torch.full((1,), 2.0)

    class Recorder(SpecDecPP):
        def begin_round(self, generated=None):
            super().begin_round(generated)
            self.head.calls = []
            self.rounds.append(self.head.calls)

    spy = Spy()
    spy.attach(draft)
    policy = Recorder(spy, threshold=0.6, max_candidates=depths)
    policy.rounds = []
    prompt = [5, 9, 13, 2, 7]
    out = SpeculativeDecoder(draft, target, policy, SamplingConfig(temperature=1.0)).generate(
        torch.tensor([prompt]), max_new_tokens=40, generator=torch.Generator().manual_seed(3))
    response = out.tokens[0, len(prompt):].tolist()
    row = {"prompt_ids": prompt, "target_ids": response, "depth_draft_ids": [[t] * depths for t in response],
           "depth_p_acc": [[1.0] * depths for _ in response]}
    (train_feats,), (labels,) = feature_draft_head_features(draft, target, [row], {**spy.feature_spec(),
                                                                                  "context": "target"})
    assert train_feats.shape == (len(response) * depths, spy.feature_size) and labels.shape == (len(response) * depths,)
    checked, n = {"k=1": 0, "k>=2": 0}, len(prompt)
    for calls, accepted in zip(policy.rounds, out.stats.accept_lengths, strict=True):
        for k, (token, feats) in enumerate(calls, start=1):
            if k > accepted:
                continue
            j = n + k - 1 - len(prompt)
            assert token is None or response[j] == token
            torch.testing.assert_close(feats, train_feats[j * depths + k - 1], atol=1e-4, rtol=1e-4)
            checked["k=1" if k == 1 else "k>=2"] += 1
        n += accepted + 1
    assert n == out.tokens.shape[1] and checked["k=1"] >= 3 and checked["k>=2"] >= 3, checked
    with pytest.raises(ValueError, match="labels' own context"):
        feature_draft_head_features(draft, target, [row], spy.feature_spec())
