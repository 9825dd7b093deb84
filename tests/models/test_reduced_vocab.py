"""Drafts with a reduced output vocabulary: q is zero outside the draft's own token set, every
consumer still sees full-vocabulary logits, and decoding stays lossless."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from specdecpp import FixedK, SamplingConfig, SpeculativeDecoder, load_pair
from specdecpp.core.sampling import entropy, warp
from specdecpp.data.labels import label_responses
from specdecpp.models.loading import load_model
from specdecpp.models.reduced_vocab import (
    OUTPUT_VOCAB_FILE,
    ReducedOutput,
    output_vocab_size,
    restrict_output_vocab,
    write_output_vocab,
)
from tests.helpers.stats import chi_square_pvalue, exact_distribution
from tests.helpers.tiny import noisy_copy, tiny_lm


def reduced(model, ids):
    m = copy.deepcopy(model)
    restrict_output_vocab(m, ids)
    return m


def test_reduced_logits_equal_the_full_layer_on_its_tokens_and_minus_inf_elsewhere():
    full = tiny_lm(40, 32, 1, seed=3)
    ids = [0, 5, 7, 11, 39]
    small = reduced(full, ids)
    x = torch.tensor([[1, 2, 3, 4]])
    a, b = full(x).logits, small(x).logits
    assert b.shape == a.shape and output_vocab_size(small) == 40
    torch.testing.assert_close(b[..., ids], a[..., ids])
    others = [t for t in range(40) if t not in ids]
    assert torch.isneginf(b[..., others]).all()
    q = warp(b[0, -1], SamplingConfig(temperature=1.0, top_k=3))
    assert q[others].sum() == 0 and q.sum().item() == pytest.approx(1.0)
    assert torch.isfinite(entropy(b[0, -1])).all()  # no nan from 0 * log 0
    assert isinstance(small.get_output_embeddings(), ReducedOutput)


def test_bad_token_ids_are_refused():
    model = tiny_lm(16, 32, 1)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 16\)"):
        restrict_output_vocab(copy.deepcopy(model), [3, 16])
    with pytest.raises(ValueError, match="already reduced"):
        restrict_output_vocab(reduced(model, [1, 2]), [1])


@pytest.fixture(scope="module")
def pair32():
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    return noisy_copy(target, 0.4, seed=6), target


def test_greedy_with_a_reduced_draft_equals_target_greedy(pair32):
    draft, target = pair32
    # the draft scores half the vocabulary: tokens the target picks outside it are never proposed
    small = reduced(draft, list(range(0, 32, 2)))
    decoder = SpeculativeDecoder(small, target, FixedK(3), SamplingConfig(temperature=0))
    accepted = 0
    for prompt, n in itertools.product([[1, 2, 3], [7], [4, 4, 9, 10]], (5, 23)):
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=n, do_sample=False)
        out = decoder.generate(ids, max_new_tokens=n)
        assert out.tokens.tolist() == ref.tolist()
        accepted += sum(out.stats.accept_lengths)
    assert accepted > 0


def test_sampled_output_with_a_reduced_draft_has_the_target_distribution():
    target = tiny_lm(5, 16, 2, seed=21, scale=0.8, heads=2)
    draft = reduced(noisy_copy(target, 0.25, seed=22), [0, 1, 3])  # q(2) = q(4) = 0
    sampling = SamplingConfig(temperature=1.0)
    prompt = [0, 1]
    expected = exact_distribution(target, prompt, 3, sampling)
    decoder = SpeculativeDecoder(draft, target, FixedK(3), sampling)
    g = torch.Generator().manual_seed(99)
    seqs, tokens = [], set()
    for _ in range(1200):
        out = decoder.generate(torch.tensor([prompt]), max_new_tokens=4, generator=g)
        seq = tuple(out.tokens[0, 2:5].tolist())
        seqs.append(seq)
        tokens.update(seq)
    assert {2, 4} & tokens  # tokens outside the draft's set still appear (from the target's residual)
    assert chi_square_pvalue(seqs, expected) > 1e-4


def test_load_model_and_load_pair_apply_the_output_vocab_file(tiny_pair, tmp_path):
    import shutil

    d = tmp_path / "draft"
    shutil.copytree(tiny_pair.draft, d)
    keep = list(range(0, tiny_pair.vocab, 3))
    write_output_vocab(d, keep, ranked_on="test")
    assert (d / OUTPUT_VOCAB_FILE).is_file()
    draft, target, tok = load_pair(str(d), tiny_pair.target, device="cpu")
    layer = draft.get_output_embeddings()
    assert isinstance(layer, ReducedOutput) and layer.token_ids.tolist() == keep
    plain = load_model(tiny_pair.draft, "cpu")
    x = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(draft(x).logits[..., keep], plain(x).logits[..., keep])
    # data_gen labels with the reduced draft: every sampled draft token lies in its set, labels valid
    g = [torch.Generator().manual_seed(i) for i in range(2)]
    labels = label_responses(draft, target, [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11, 12]],
                             SamplingConfig(temperature=1.0), g)
    for lab in labels:
        assert set(lab.draft_ids.tolist()) <= set(keep)
        assert ((lab.p_acc >= 0) & (lab.p_acc <= 1)).all() and torch.isfinite(lab.draft_entropy).all()
    (d / OUTPUT_VOCAB_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=OUTPUT_VOCAB_FILE):
        load_model(str(d), "cpu")


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_softmax_statistics_over_the_scored_logits_equal_those_over_the_whole_vocabulary(temperature):
    """SVIP's entropy and the lag-free head's features read only a reduced draft's scored logits
    (ScoredIds): the same numbers as over all of them, the -inf ones included, for 1-D and 2-D
    logits, and a token outside the scored set still gets q = 0 (logprob clamped at -50)."""
    from specdecpp.models.reduced_vocab import ScoredIds
    from specdecpp.stopping.head import ALL_NEXT_FEATURES, next_token_features

    full = tiny_lm(64, 32, 1, seed=9, scale=1.0)
    ids = list(range(1, 64, 3))
    small = reduced(full, ids)
    x = torch.tensor([[1, 2, 3, 4, 5]])
    out = small(x, output_hidden_states=True)
    logits, hidden = out.logits[0], out.hidden_states[-1][0]  # [5, 64], 43 logits at -inf per row
    support = ScoredIds(small)(logits)
    assert support.tolist() == ids and ScoredIds(small)(logits[:, :30]).tolist() == [i for i in ids if i < 30]
    assert ScoredIds(full)(logits) is None
    torch.testing.assert_close(entropy(logits, temperature, support), entropy(logits, temperature))
    torch.testing.assert_close(entropy(logits[2], temperature, support), entropy(logits[2], temperature))
    tokens = torch.tensor([1, 4, 61, 2, 0])  # 2 and 0 are not scored: q_T = 0 there
    args = (hidden, logits, tokens, small.get_input_embeddings(), temperature, ALL_NEXT_FEATURES, 4,
            torch.arange(5))
    with_support = next_token_features(*args, support=support)
    torch.testing.assert_close(with_support, next_token_features(*args))
    prob, logprob = with_support[:, 64], with_support[:, 65]  # after hidden (32) and embedding (32)
    assert prob[3:].tolist() == [0.0, 0.0] and logprob[3:].tolist() == [-50.0, -50.0] and (prob[:3] > 0).all()


def test_svip_and_the_lag_free_head_read_the_scored_logits_of_the_draft_they_are_bound_to():
    from specdecpp import SVIP, SpecDecPP
    from specdecpp.stopping.head import NextTokenHead

    small = reduced(tiny_lm(64, 32, 1, seed=9, scale=1.0), list(range(0, 64, 4)))
    svip, head = SVIP(0.3), NextTokenHead(32, 1)
    svip.bind(small, 1.0)
    SpecDecPP(head).bind(small, 1.0)
    logits = small(torch.tensor([[3, 4]])).logits[0]
    assert svip.support(logits).tolist() == head.__dict__["_support"](logits).tolist() == list(range(0, 64, 4))
