"""How often a chain round reads a device value on the host. On CUDA each read is a synchronisation,
after which the GPU idles while the host launches the next work; on CUDA graphs that idling was most
of the loop's 8-42% of a round (an H100, before rounds were captured: `git show c4b00e1:docs/results/gpu.md`,
"The fast path on the demo pair, on a lent H100"). The engine reads once per round, in the acceptance
rule: sampled, the verdict with the check of the draft's rows, the drafts' values and the next token
(every candidate replacement drawn before the read) with its check; greedy, the argmaxes with the
drafts. It never reads while it drafts under fixed K (a draw's check waits for the rule's read) or in the
commit, which takes the drafts the rule read (gpu only: torch.cuda's sync debug mode attributes each
synchronisation to the engine's frames)."""

from __future__ import annotations

import gc
import threading
import traceback
import warnings

import pytest
import torch

from specdecpp import FixedK, SamplingConfig, SpeculativeDecoder, TargetOnly
from tests.helpers.tiny import noisy_copy, tiny_lm


class Sync(list):
    """The names of the engine's functions (specdecpp's frames) on the stack of one synchronisation;
    ``where``: the whole stack's last frames and the warning, for a failure to name."""

    where: str


def engine_syncs(run, *args):
    """``run(*args)`` under torch.cuda's sync debug mode: its result, and for each implicit
    synchronisation a :class:`Sync`."""
    found = []
    caller = threading.get_ident()

    def note(message, category, filename, lineno, file=None, line=None):
        # Only the sync debug mode's warnings, and only on the thread that runs the call: the mode is
        # process-wide. On an H200 a greedy call saw one such warning with no engine frame on its stack
        # (the fifth and sixth leases: `git show c4b00e1:docs/results/gpu.md`, "Captured rounds on a lent
        # H200" and "Fused rounds on a lent H200"; the latest: docs/results/gpu.md, "The tests on CUDA"):
        # ``where`` keeps what a failure needs to name its source.
        if threading.get_ident() == caller and "synchroniz" in str(message):
            stack = traceback.extract_stack()[:-1]
            sync = Sync(f.name for f in stack if "/specdecpp/" in f.filename)
            sync.where = f"{filename}:{lineno}: {str(message)[:200]}\n" + "".join(traceback.format_list(stack[-15:]))
            found.append(sync)

    # The collector runs finalizers at whatever allocation it triggers on, and a finalizer of an earlier
    # call's garbage (a CUDA graph, its memory pool) may synchronise: that is no read of this call's, and
    # the H200's unattributed synchronisation came before the call's first engine frame, where only such
    # a finalizer could run (`git show c4b00e1:docs/results/gpu.md`, "Fused rounds on a lent H200", the
    # sixth lease; unverified). So: collect first, none inside.
    gc.collect()
    collecting = gc.isenabled()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        gc.disable()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            if collecting:
                gc.enable()
    return result, found


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [None, "static"])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)],
                         ids=["greedy", "T1"])
def test_a_round_reads_once_in_the_rule_and_never_while_drafting_or_committing(fast, sampling):
    target = tiny_lm(64, 32, 2, seed=5, scale=0.4)
    draft = noisy_copy(target, 0.3, seed=6).cuda()
    target = target.cuda()
    for policy in (FixedK(3), TargetOnly()):
        decoder = SpeculativeDecoder(draft, target, policy, sampling, fast=fast)
        prompt = torch.tensor([[1, 2, 3]], device="cuda")
        decoder.generate(prompt, 4, torch.Generator().manual_seed(0))  # warm-up: kernels, allocator
        out, syncs = engine_syncs(decoder.generate, prompt, 24, torch.Generator().manual_seed(1))
        rounds = len(out.stats.accept_lengths)
        drafting = [s for s in syncs if "block" in s and "feed" not in s]  # the drafter's own reads, not a forward's
        in_rule = [s for s in syncs if "verify" in s]
        assert drafting == [], drafting
        assert [s for s in syncs if "commit" in s] == []
        assert len(in_rule) <= rounds, (len(in_rule), rounds, in_rule[:4])


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0, top_k=10)],
                         ids=["greedy", "T1-top10"])
def test_a_replayed_round_reads_once(sampling):
    """fast='graphs' under fixed K and target-only: each round after the prefill's is one captured
    graph (specdecpp/decoders/captured.py, replay.py), after which the host reads one tensor, and nothing else
    in the call reads more than the rounds do."""
    target = tiny_lm(64, 32, 2, seed=5, scale=0.4)
    draft = noisy_copy(target, 0.3, seed=6).cuda()
    target = target.cuda()
    for policy in (FixedK(3), TargetOnly()):
        decoder = SpeculativeDecoder(draft, target, policy, sampling, fast="graphs")
        prompt = torch.tensor([[1, 2, 3]], device="cuda")
        decoder.warm_up(3, 24)  # every bucket captured (a capture synchronises), then the round graph:
        decoder.generate(prompt, 8, torch.Generator().manual_seed(0))
        out, syncs = engine_syncs(decoder.generate, prompt, 24, torch.Generator().manual_seed(1))
        # RoundGraph.run's read, under CapturedRounds.replay (specdecpp/decoders/replay.py)
        replayed = [s for s in syncs if s[-2:] == ["replay", "run"]]
        assert out.stats.replayed_rounds >= 4
        assert len(replayed) == out.stats.replayed_rounds, (len(replayed), out.stats)
        # the call's clock synchronises at its start, first round and end
        rounds = [s for s in syncs if s[-1:] != ["now"]]
        assert len(rounds) <= len(out.stats.accept_lengths), (rounds, [s.where for s in rounds if not s])


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0, top_k=10)],
                         ids=["greedy", "T1-top10"])
def test_an_adaptive_replayed_round_reads_once_per_candidate_and_once_after(sampling):
    """fast='graphs' under SVIP and a SpecDec++ head: a round is a graph per candidate, each read once
    (its stop flag and value, as the uncaptured drafter reads a value-reading policy), then the
    verdict's graph, read once (specdecpp/decoders/captured.py, StepGraphs)."""
    from specdecpp import SVIP, AcceptanceHead, SpecDecPP

    target = tiny_lm(64, 32, 2, seed=5, scale=0.4)
    draft = noisy_copy(target, 0.3, seed=6).cuda()
    target = target.cuda()
    torch.manual_seed(1)
    for policy in (SVIP(0.6, max_candidates=4), SpecDecPP(AcceptanceHead(32, 2).cuda(), 0.5, max_candidates=4)):
        decoder = SpeculativeDecoder(draft, target, policy, sampling, fast="graphs")
        prompt = torch.tensor([[1, 2, 3]], device="cuda")
        decoder.warm_up(3, 24)
        decoder.generate(prompt, 8, torch.Generator().manual_seed(0))
        out, syncs = engine_syncs(decoder.generate, prompt, 24, torch.Generator().manual_seed(1))
        s = out.stats
        replayed = [x for x in syncs if x[-2:] == ["replay", "run"]]  # StepGraphs.run's reads
        assert s.replayed_rounds >= len(s.accept_lengths) - 2
        replayed_k = s.candidate_lengths[1 : 1 + s.replayed_rounds]  # the prefill's round is not replayed
        assert len(replayed) == sum(replayed_k) + s.replayed_rounds, (len(replayed), s)
        assert [x for x in syncs if "commit" in x] == []
