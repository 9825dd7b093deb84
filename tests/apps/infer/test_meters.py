"""infer.meters.FeedMeters: a decoder's runners timed from outside. The decoder's output does not
change, every feed, step and mask is counted once in its phase, and the parts nest (a feed holds
its step and its mask); eager runners have feeds only."""

from __future__ import annotations

import pytest
import torch

from infer.meters import FeedMeters
from specdecpp import FixedK, SamplingConfig, SpeculativeDecoder
from specdecpp.core.timing import Clock


@pytest.mark.parametrize("fast", [None, "static"])
def test_feed_meters_count_every_feed_in_its_phase_and_change_no_output(tiny_models, fast):
    draft, target = tiny_models
    decoder = SpeculativeDecoder(draft, target, FixedK(2), SamplingConfig(temperature=1.0, top_k=5), fast=fast)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    plain = decoder.generate(prompt, 12, torch.Generator().manual_seed(3))
    inner = decoder.runners
    decoder.runners = meters = FeedMeters(inner, {id(draft): "draft", id(target): "target"}, Clock(draft.device))
    assert meters.fast == fast  # everything else is the wrapped factory's
    out = decoder.generate(prompt, 12, torch.Generator().manual_seed(3))
    assert torch.equal(out.tokens, plain.tokens)  # same seed, same output: the wrappers change nothing
    s = out.stats
    rounds = len(s.accept_lengths)
    # one prefill feed per model; then the target feeds once per later round, the draft once per draft call
    assert meters.calls[("draft", "prefill", "feed")] == meters.calls[("target", "prefill", "feed")] == 1
    assert meters.calls[("target", "round", "feed")] == rounds - 1
    assert meters.calls[("draft", "round", "feed")] == s.n_draft_calls - 1
    for role, phase, part in list(meters.calls):
        if fast:  # a static runner's feed runs one step and builds one mask
            assert meters.calls[(role, phase, "step")] == meters.calls[(role, phase, "mask")] == \
                meters.calls[(role, phase, "feed")]
            assert meters.seconds[(role, phase, "feed")] > meters.seconds[(role, phase, "step")] + \
                meters.seconds[(role, phase, "mask")] > 0
        else:
            assert part == "feed"
    total = meters.total()
    assert total == pytest.approx(meters.total("prefill") + meters.total("round")) and 0 < total < s.wall_time_s
    meters.reset()
    assert meters.total() == 0 and not meters.calls
