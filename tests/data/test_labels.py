"""specdecpp.data.labels: sampled responses (batched, continuous batching, EOS) equal one prompt at a
time, kept target probabilities label like a target forward, left padding, chunked labels and the
fallback for post-processed logits. (The data_gen app: tests/apps/data_gen/test_data_gen.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

from specdecpp.core.sampling import SamplingConfig, sample, warp
from specdecpp.data.labels import label_responses, left_pad, prompt_generator, sample_responses
from tests.helpers.tiny import tiny_lm


def test_sample_responses_batched_with_eos_equals_single():
    """Rows that stop at different steps leave the batch; the rest are unaffected."""
    target = tiny_lm(40, 32, 2, seed=5, scale=0.5)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12]]
    eos = set(range(30, 40))
    cfg = SamplingConfig(1.0)
    batched = sample_responses(target, prompts, cfg, 12, [prompt_generator(3, str(i)) for i in range(4)], eos)
    single = [sample_responses(target, [p], cfg, 12, [prompt_generator(3, str(i))], eos)[0]
              for i, p in enumerate(prompts)]
    assert batched == single
    lengths = [len(r) for r in batched]
    assert min(lengths) < 12  # some row stopped early at EOS
    for r in batched:
        assert all(t not in eos for t in r[:-1]) and (len(r) == 12 or r[-1] in eos)
    labels = label_responses(tiny_lm(40, 16, 1, seed=6, scale=0.5), target, prompts, batched, cfg,
                             [prompt_generator(4, str(i)) for i in range(4)])
    assert [len(lab.p_acc) for lab in labels] == lengths


@pytest.mark.parametrize("fast", [None, "static"], ids=["eager", "fast_static"])
@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_continuous_batching_refills_finished_rows_and_equals_single(batch_size, fast):
    """A queue of prompts through batch_size places: finished rows leave and the next prompts
    (prefilled, joined to the cache with their own positions) take their places; every response
    equals the one-prompt run (eager), and the step count shows the places were refilled; on the
    fast path's static batch runner too."""
    target = tiny_lm(40, 32, 2, seed=5, scale=0.5)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17], [18, 19, 20, 21, 22, 23, 24]]
    eos = set(range(30, 40))
    cfg = SamplingConfig(1.0)
    steps = []
    continuous = sample_responses(target, prompts, cfg, 12, [prompt_generator(3, str(i)) for i in range(7)], eos,
                                  on_tokens=steps.append, batch_size=batch_size, fast=fast)
    single = [sample_responses(target, [p], cfg, 12, [prompt_generator(3, str(i))], eos)[0]
              for i, p in enumerate(prompts)]
    assert continuous == single
    assert sum(steps) == sum(len(r) for r in single) and max(steps) == batch_size
    assert min(len(r) for r in single) < 12  # some rows stopped early at EOS
    static_steps = sum(max(len(r) for r in single[i:i + batch_size]) for i in range(0, 7, batch_size))
    assert len(steps) < static_steps or batch_size == 1  # refilled: fewer steps than static batches


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0, 5), SamplingConfig(0.8, 0, 0.9), SamplingConfig(0.0)])
def test_kept_target_probs_give_the_labels_of_a_target_forward(sampling, monkeypatch):
    """p_i kept while sampling (top-k, top-p, greedy supports) labels like a second target forward;
    a support too wide to keep falls back to that forward."""
    import specdecpp.data.labels as labels

    draft, target = tiny_lm(40, 16, 1, seed=6, scale=0.5), tiny_lm(40, 32, 2, seed=5, scale=0.5)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12]]
    responses, kept = labels.sample_responses_with_probs(target, prompts, sampling, 10,
                                                         [prompt_generator(3, str(i)) for i in range(4)], batch_size=2)
    assert responses == sample_responses(target, prompts, sampling, 10, [prompt_generator(3, str(i)) for i in range(4)])
    with_kept = label_responses(draft, target, prompts, responses, sampling,
                                [prompt_generator(4, str(i)) for i in range(4)], target_probs=kept)
    recomputed = label_responses(draft, target, prompts, responses, sampling,
                                 [prompt_generator(4, str(i)) for i in range(4)])
    for a, b in zip(with_kept, recomputed, strict=True):
        assert a.draft_ids.tolist() == b.draft_ids.tolist()
        torch.testing.assert_close(a.p_acc, b.p_acc, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(labels, "MAX_KEPT_SUPPORT", 0 if sampling.greedy else 1)
    wide = labels.sample_responses_with_probs(target, prompts, sampling, 10,
                                              [prompt_generator(3, str(i)) for i in range(4)], batch_size=2)
    assert wide[0] == responses and (wide[1] is None) == (not sampling.greedy)


def test_left_pad_masks_and_positions():
    ids, mask, pos = left_pad([[7, 8, 9], [5]], torch.device("cpu"))
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_chunked_labels_equal_whole_ones_and_post_processed_logits_fall_back(monkeypatch):
    """Labelling a chunk of positions at a time gives the same labels as one piece; a model whose
    output layer does not reproduce its logits (soft-capping, scaling) gets its whole logits."""
    import specdecpp.data.labels as labels_module

    draft, target = tiny_lm(40, 16, 1, seed=6, scale=0.5), tiny_lm(40, 24, 2, seed=7, scale=0.5)
    prompts = [[1, 2, 3], [4, 5]]
    responses = [list(range(5, 30)), list(range(8, 20))]
    cfg = SamplingConfig(temperature=1.0, top_k=10)

    def run(draft_model):
        return label_responses(draft_model, target, prompts, responses, cfg,
                               [torch.Generator().manual_seed(b) for b in range(2)])

    whole = run(draft)
    monkeypatch.setattr(labels_module, "LABEL_CHUNK_ELEMENTS", 40 * 3)  # 3 positions per chunk
    chunked = run(draft)
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a.draft_ids, b.draft_ids)
        torch.testing.assert_close(a.p_acc, b.p_acc)
        torch.testing.assert_close(a.draft_entropy, b.draft_entropy)

    capped = copy.deepcopy(draft)  # logits 3 * tanh(x / 3), as Gemma-style soft-capping
    real_forward = capped.forward

    def soft_capped(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        out.logits = 3 * torch.tanh(out.logits / 3)
        return out

    capped.forward = soft_capped
    fallback = run(capped)
    reference = []
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):  # an independent recomputation
        logits = soft_capped(torch.tensor([p + r[:-1]])).logits[0, len(p) - 1:]
        q = warp(logits, cfg)
        reference.append(sample(q, torch.Generator().manual_seed(b)))
    assert [f.draft_ids.tolist() for f in fallback] == [y.tolist() for y in reference]
    assert [f.draft_ids.tolist() for f in fallback] != [w.draft_ids.tolist() for w in whole]


def _feature_pair():
    from specdecpp.models.feature_draft import FeatureDraft

    target = tiny_lm(40, 32, 4, seed=11, scale=0.5)
    draft = FeatureDraft.init_from(target, draft_vocab=torch.arange(0, 40, 2),
                                   generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return draft, target


def _drafted_logits(draft, target, seq: list[int], s: int, d: int) -> torch.Tensor:
    """q's logits for the token at absolute position ``s`` drafted as a round's d-th candidate, by
    drafting with the draft's cache: target features up to s - 1 - d, then d - 1 own steps."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        feats = draft.fuse(target(ids, output_hidden_states=True).hidden_states)
        a = s - 1 - d
        cache = draft.new_cache()
        out = draft(ids[:, 1:a + 2], features=feats[:, :a + 1], cache=cache)
        for k in range(1, d):
            out = draft(ids[:, a + 1 + k:a + 2 + k], hidden=out.hidden[:, -1:], cache=cache)
    return out.logits[0, -1]


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5)],
                         ids=["T1", "T0.7-top5"])
def test_feature_draft_labels_at_each_depth_equal_drafting_with_a_cache(sampling):
    """A feature draft's labels: at depth d the q of response token X_i is what drafting it as a
    round's d-th candidate computes (features up to s - 1 - d, own outputs after), Y ~ q (q > 0 at
    Y), p_acc = min(1, p(Y) / q(Y)); depth 1 fills the plain columns; a prompt too short for a depth
    gives NaN there and no draw."""
    draft, target = _feature_pair()
    prompts, responses = [[3, 7, 1, 4, 9], [2, 5]], [[6, 6, 2, 8, 1, 0], [9, 3, 3, 1]]
    gens = [torch.Generator().manual_seed(b) for b in range(2)]
    labels = label_responses(draft, target, prompts, responses, sampling, gens, depths=3)
    for b, (prompt, response, lab) in enumerate(zip(prompts, responses, labels, strict=True)):
        seq = prompt + response
        assert lab.depth_p_acc.shape == (len(response), 3)
        assert torch.equal(lab.depth_p_acc[:, 0], lab.p_acc) and torch.equal(lab.depth_draft_ids[:, 0], lab.draft_ids)
        with torch.no_grad():
            p_all = warp(target(torch.tensor([seq])).logits[0], sampling)
        for i in range(len(response)):
            s = len(prompt) + i
            for d in (1, 2, 3):
                if s - 1 - d < 0:
                    assert lab.depth_p_acc[i, d - 1].isnan() and lab.depth_draft_ids[i, d - 1] == -1, (b, i, d)
                    continue
                q = warp(_drafted_logits(draft, target, seq, s, d), sampling)
                y = int(lab.depth_draft_ids[i, d - 1])
                assert q[y] > 0, (b, i, d)
                p = p_all[s - 1]
                want = min(1.0, float(p[y] / q[y]))
                assert abs(float(lab.depth_p_acc[i, d - 1]) - want) < 1e-4, (b, i, d)
                assert not lab.depth_draft_entropy[i, d - 1].isnan()
    assert labels[1].depth_p_acc[0, 2].isnan()  # prompt of 2: no round has X_0 as its third candidate


def test_feature_draft_labels_refuse_what_they_cannot_label():
    from specdecpp.decoders.cascade import Cascade

    draft, target = _feature_pair()
    sampling = SamplingConfig(temperature=1.0)
    with pytest.raises(ValueError, match="at least 2 tokens.*prompt 0 has 1"):
        label_responses(draft, target, [[4]], [[1, 2]], sampling, [torch.Generator()])
    with pytest.raises(ValueError, match="cascade"):
        label_responses(draft, target, [[4, 5]], [[1, 2]], sampling, [torch.Generator()],
                        cascade=Cascade("opt", 0.1))
