"""Sampled speculative decoding through vLLM on a CPU at the paper's setting (T=1, top-k 50): the
first two tokens follow the target's distribution (chi-square against exact enumeration) with
specdecpp's fixes of vLLM 0.32's CPU sampling bugs, and each bug is detected where it is present
(docs/vllm.md, "Two CPU sampling bugs")."""

from __future__ import annotations

import time

import pytest

from tests.helpers.vllm import require_vllm

require_vllm()

import torch  # noqa: E402

from specdecpp import SamplingConfig, warp  # noqa: E402
from specdecpp.stopping.head import build_head  # noqa: E402
from specdecpp.vllm import internals, speculative_config  # noqa: E402
from specdecpp.vllm.load_aware import StepCosts  # noqa: E402
from tests.helpers.stats import chi_square_pvalue  # noqa: E402
from tests.helpers.vllm import VLLM_WARNINGS, close, recorded_lengths, save_pair, spec_metrics, start  # noqa: E402

pytestmark = VLLM_WARNINGS
VOCAB, PROMPT, SAMPLES = 64, [1, 2, 3], 4000
SAMPLING = SamplingConfig(temperature=1.0, top_k=50)


def exact_pairs(target_dir) -> dict:
    """P(y1, y2 | PROMPT) under the target's warped distribution, by enumeration (transformers)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def probs(ids):
        with torch.no_grad():
            return warp(target(torch.tensor([ids])).logits[0, -1], SAMPLING)

    p1, dist = probs(PROMPT), {}
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = probs(PROMPT + [a])
        dist.update({(a, b): float(p1[a] * p2[b]) for b in torch.nonzero(p2).flatten().tolist()})
    return dist


def varied_next_head(hidden: int):
    with torch.random.fork_rng():
        torch.manual_seed(7)
        head = build_head("next", hidden, 0)
    with torch.no_grad():
        head.out.weight.mul_(20.0)
        head.out.bias.fill_(1.0)
    return head


# 64 requests: flat to their 64 tokens, then a verified candidate costs 0.6 of what a request's token
# earns at that rate, so a first candidate is kept where its estimated acceptance is above about 0.6
MIXED_COSTS = StepCosts((1, 64, 256), (0.01, 0.01, 0.028), (1, 64), (0.001, 0.001))


@pytest.mark.parametrize("load_aware", [None, MIXED_COSTS], ids=["head", "head+load_aware"])
def test_the_first_two_tokens_follow_the_target_at_t1_top_k_50(tmp_path, load_aware):
    """The lag-free head's own stops, and with load-aware lengths, which drop some requests' first
    candidates (length 0, from the side estimator's estimate made before the candidate is drawn)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    draft, target = save_pair(tmp_path, vocab=VOCAB, noise=0.15)
    spec = speculative_config(draft, head=varied_next_head(128), threshold=0.5, max_candidates=3,
                              cache_dir=tmp_path / "bundles", load_aware=load_aware)
    began = time.perf_counter()
    llm = start(target, spec, skip_tokenizer_init=True, max_model_len=64, max_num_seqs=64)
    print(f"engine start-up {time.perf_counter() - began:.1f} s")
    try:
        with recorded_lengths() as lengths:
            outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * SAMPLES,
                                SamplingParams(temperature=1.0, top_k=50, max_tokens=3, detokenize=False,
                                               ignore_eos=True), use_tqdm=False)
        metrics = spec_metrics(llm)
    finally:
        close(llm)
    assert "expand" in internals.REPLACED and "top_k" in internals.REPLACED  # both fixes were needed and applied
    samples = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    assert chi_square_pvalue(samples, exact_pairs(target)) > 1e-3
    assert any(len(set(step)) > 1 for step in lengths)  # rows stopped at their own lengths
    if load_aware is not None:
        assert any(0 in step and max(step) > 0 for step in lengths)  # some first candidates dropped, not all
    # the pair accepts about 0.29 of its second tokens (sum of min(p, q)); the bug made it ~0
    assert metrics["num_accepted_tokens"] > 0.15 * metrics["num_drafts"]


def test_the_expand_bug_is_detected_in_vllms_cpu_kernel():
    """vLLM 0.32's CPU expand_kernel converts its float output to an int64 copy and never writes it
    back (and truncates the values to integers): a spec-decode step's per-token temperatures are
    uninitialised memory. The replacement expands exactly."""
    from vllm.utils import cpu_triton_utils

    original = internals.REPLACED.get("expand", cpu_triton_utils._expand_kernel_impl)
    assert internals.expand_bug_present(original)
    assert not internals.expand_bug_present(internals.expand_kernel_impl)
    out = torch.full((5,), -1, dtype=torch.int32)
    internals.expand_kernel_impl(out, torch.tensor([0, 7], dtype=torch.int32), torch.tensor([3, 5]), 0, 9)
    assert out.tolist() == [9, 9, 9, 7, 7]  # replace_from -> replace_to, as the Triton kernel does


def test_the_top_k_bug_is_detected_and_the_wrapper_passes_an_empty_batch():
    """A spec-decode step in which no request has a draft token left hands the rejection sampler's
    top-k an empty batch; vLLM 0.32's CPU path calls k.max() on it and raises."""
    from vllm.v1.sample.ops import topk_topp_sampler

    original = internals.REPLACED.get("top_k", topk_topp_sampler.apply_top_k_only)
    assert internals.top_k_bug_present(original)
    internals.install_top_k_fix()
    assert not internals.top_k_bug_present(topk_topp_sampler.apply_top_k_only)
    logits = torch.randn(3, 8)
    expected = original(logits.clone(), torch.tensor([2, 8, 5]))
    assert torch.equal(topk_topp_sampler.apply_top_k_only(logits.clone(), torch.tensor([2, 8, 5])), expected)


@pytest.mark.parametrize("env", [internals.KEEP_EXPAND_ENV, internals.KEEP_TOP_K_ENV])
def test_each_fix_can_be_declined(monkeypatch, env):
    monkeypatch.setenv(env, "1")
    fix = internals.install_expand_fix if env == internals.KEEP_EXPAND_ENV else internals.install_top_k_fix
    assert fix() is False
