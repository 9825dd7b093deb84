"""Greedy decoding through vLLM with each stop policy gives vLLM target-only's tokens on every
prompt, and the per-request lengths of one step differ (tiny random pair; the demo pair: slow).

One engine per policy (vLLM starts in ~10 s here); each is closed before the next starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.vllm import require_vllm

require_vllm()

import torch  # noqa: E402

from specdecpp import SVIP, FixedK  # noqa: E402
from specdecpp.stopping.head import build_head  # noqa: E402
from specdecpp.vllm import speculative_config  # noqa: E402
from tests.helpers.vllm import VLLM_WARNINGS, close, recorded_lengths, save_pair, spec_metrics, start  # noqa: E402

pytestmark = VLLM_WARNINGS

PROMPTS = ["Write a short poem about the sea.", "Explain how a binary search works.", "def add(a, b):",
           "The quick brown fox", "What is 12 times 7?", "Give three tips for staying healthy."]
MAX_TOKENS = 24
DEMO = Path(__file__).resolve().parents[2] / ".cache" / "demo"


def greedy_tokens(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("vllm_pair"))


@pytest.fixture(scope="module")
def reference(pair):
    """vLLM target-only's greedy tokens."""
    began = time.perf_counter()
    llm = start(pair[1])
    print(f"target-only engine start-up {time.perf_counter() - began:.1f} s")
    try:
        return greedy_tokens(llm)
    finally:
        close(llm)


def varied_head(kind: str, seed: int):
    """A seeded head of the draft's size whose predictions vary from candidate to candidate (its
    output layer scaled up: a random head's logits are small), so rows stop at different lengths."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = build_head(kind, 64, 0)
    with torch.no_grad():
        head.out.weight.mul_(20.0)
        head.out.bias.fill_(1.5)
    return head


# SVIP's threshold puts this pair's stops in the middle of their range
POLICIES = {
    "fixed_k": lambda: {"stop_policy": FixedK(3)},
    "svip": lambda: {"stop_policy": SVIP(0.86, max_candidates=4)},
    "resnet_head": lambda: {"head": varied_head("resnet", 1), "threshold": 0.5, "max_candidates": 4},
    "next_head": lambda: {"head": varied_head("next", 2), "threshold": 0.5, "max_candidates": 4},
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_policy_gives_target_only_tokens(pair, reference, tmp_path, name):
    spec = speculative_config(pair[0], cache_dir=tmp_path, **POLICIES[name]())
    began = time.perf_counter()
    llm = start(pair[1], spec)
    print(f"{name} engine start-up {time.perf_counter() - began:.1f} s")
    try:
        with recorded_lengths() as lengths:
            tokens = greedy_tokens(llm)
        metrics = spec_metrics(llm)
    finally:
        close(llm)
    assert tokens == reference
    assert lengths, "the proposer of specdecpp.vllm did not run (is the vllm.general_plugins entry point installed?)"
    assert all(0 < n <= spec["num_speculative_tokens"] for step in lengths for n in step)
    assert metrics["num_drafts"] > 0
    if name == "fixed_k":
        assert all(n == 3 for step in lengths for n in step)
    else:  # per-request lengths reach the scheduler: they differ within one step
        assert any(len(set(step)) > 1 for step in lengths), lengths
        # what vLLM verified is what the proposer handed it (less the drafts cut at max_tokens)
        assert metrics["num_draft_tokens"] <= sum(map(sum, lengths))


@pytest.mark.slow
@pytest.mark.skipif(not (DEMO / "draft").is_dir(), reason="no demo pair in .cache/demo (make demo-pair)")
def test_the_demo_pair_gives_target_only_tokens(tmp_path):
    prompts = PROMPTS[:4]
    llm = start(DEMO / "target", max_model_len=512, max_num_seqs=4)
    try:
        reference = greedy_tokens(llm, prompts, 32)
    finally:
        close(llm)
    head = Path(__file__).resolve().parents[2] / "demo" / "heads" / "next_wrej1_d1"  # a trained head of the pair
    for name, policy in (("fixed_k", {"stop_policy": FixedK(2)}),
                         ("svip", {"stop_policy": SVIP(0.5, max_candidates=4)}),
                         ("head", {"head": head, "threshold": 0.5, "max_candidates": 4})):
        llm = start(DEMO / "target", speculative_config(DEMO / "draft", cache_dir=tmp_path, **policy),
                    max_model_len=512, max_num_seqs=4)
        try:
            with recorded_lengths() as lengths:
                assert greedy_tokens(llm, prompts, 32) == reference, name
            assert lengths, name
        finally:
            close(llm)
