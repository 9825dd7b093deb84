"""Captured rounds (specdecpp/decoders/captured.py): under fast='graphs' a fixed-K or target-only round
is one CUDA graph. On the CPU the graph is tests/helpers/graph_tape.py's fake, which keeps a CUDA graph's
rules (a replay re-executes the operations recorded at capture on the same tensors, so whatever the
Python decided at capture stays decided; host reads and random draws are refused during capture); on
CUDA (``gpu``) the real capture. The rounds
must be exact by the same tests as every decoder: greedy output equals the target's own, sampled
output has the target's exact distribution (chi-square against enumeration, EOS included; for target-only
and the adaptive policies the exactness registry's graphs cases sample it, below), the same seed gives
the same output, and the caches after many replayed rounds equal a fresh prefill. Rounds
are replayed (counted), each round graph is captured once, and the rounds that must not be captured
(logits hooks, profile, capture_rounds=False) are not. An adaptive policy's rounds (SVIP, the heads) are
captured a candidate at a time (StepGraphs): their stop decisions equal the round-by-round drafter's."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from specdecpp import (
    SVIP,
    AcceptanceHead,
    FixedK,
    NextTokenHead,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
    TargetOnly,
)
from specdecpp.decoders.rounds import CallHooks
from specdecpp.fast.step import model_steps
from specdecpp.stopping.policies import StopPolicy
from tests.decoders.test_exactness import PROMPT, _pair6, assert_cache_is_fresh_prefill
from tests.helpers.stats import chi_square_pvalue, exact_distribution, sampled_grid
from tests.helpers.tiny import noisy_copy, tiny_lm
from tests.models.test_graphs import graphs_on  # noqa: F401  (a fixture)

DEVICES = [pytest.param("cpu", id="cpu-fake"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
POLICIES = [pytest.param(lambda: TargetOnly(), id="target_only"), pytest.param(lambda: FixedK(1), id="k1"),
            pytest.param(lambda: FixedK(3), id="k3")]


def pair32(device: str):
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    draft = noisy_copy(target, 0.1, seed=6)  # close enough that whole blocks are accepted too
    return draft.to(device), target.to(device), target


def greedy_reference(model, prompt: list[int], n: int, eos: int | None) -> list[int]:
    """The target's own greedy decoding of ``prompt``, ``n`` new tokens or up to and with an EOS."""
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)[0].tolist()
    return ref[: ref.index(eos, len(prompt)) + 1] if eos in ref[len(prompt):] else ref


def rounds_captured(model) -> list:
    return [k for k in model_steps(model).capture_seconds if k[0] == "round"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
def test_replayed_rounds_equal_target_greedy_and_capture_once(graphs_on, device, policy):  # noqa: F811
    graphs_on(device)
    draft, target, cpu_target = pair32(device)
    decoder = SpeculativeDecoder(draft, target, policy(), SamplingConfig(temperature=0), fast="graphs")
    by_round = SpeculativeDecoder(draft, target, policy(), SamplingConfig(temperature=0), fast="static")
    accepted, captured = [], []
    for _ in range(2):
        for prompt, n, eos in itertools.product([[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]], (1, 6, 21), (None, 9)):
            ref = greedy_reference(cpu_target, prompt, n, eos)
            out = decoder.generate(torch.tensor([prompt], device=device), max_new_tokens=n, eos_token_id=eos)
            assert out.tokens[0].cpu().tolist() == ref, (prompt, n, eos)
            # the draft's greedy candidates are the round-by-round drafter's: the same accepted counts
            # (exactness alone would hold with any drafts)
            host = by_round.generate(torch.tensor([prompt], device=device), max_new_tokens=n, eos_token_id=eos)
            assert out.stats.accept_lengths == host.stats.accept_lengths, (prompt, n, eos)
            rounds = len(out.stats.accept_lengths)
            if n == 21 and eos is None:  # after the prefill's round every round fits until the last K
                assert out.stats.replayed_rounds >= rounds - 1 - decoder.policy.max_candidates, out.stats
            accepted += [a for a, c in zip(out.stats.accept_lengths, out.stats.candidate_lengths, strict=True) if c]
        captured.append(list(rounds_captured(target)))
    assert len(captured[0]) == 1 and captured[1] == captured[0]  # one round graph, captured once
    if decoder.policy.max_candidates:
        assert 0 in accepted and decoder.policy.max_candidates in accepted  # rejections and full blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
def test_replayed_rounds_same_seed_same_output(graphs_on, device, policy):  # noqa: F811
    graphs_on(device)
    draft, target, _ = pair32(device)
    decoder = SpeculativeDecoder(draft, target, policy(), SamplingConfig(temperature=1.0, top_k=10), fast="graphs")

    def run(seed):
        out = decoder.generate(torch.tensor([[1, 2]], device=device), 24, generator=torch.Generator().manual_seed(seed))
        assert out.stats.replayed_rounds >= len(out.stats.accept_lengths) // 2 > 0
        return out.tokens.tolist(), out.stats.accept_lengths

    first = run(0)
    assert run(0) == first and run(1) != first


SAMPLINGS = [pytest.param(SamplingConfig(temperature=1.0), None, id="T1"),
             pytest.param(SamplingConfig(temperature=0.8, top_k=3), 2, id="T0.8-top3-eos2")]


# Target-only is not in this grid: the exactness registry's chain-target_only-fast_graphs cases are the
# same decoder, pair, prompt, samplings and seed (4 new tokens: every round after the first replayed,
# nearly 3 a call), and the greedy and same-seed tests above assert that its rounds are replayed.
@pytest.mark.parametrize("policy,sampling,eos,device", sampled_grid(
    POLICIES[1:], SAMPLINGS, DEVICES, fast={"k3-T1", "k1-T0.8-top3-eos2"}))
def test_replayed_rounds_have_the_target_distribution(graphs_on, policy, sampling, eos, device):  # noqa: F811
    """The first 3 tokens of 6 generated follow the target's exact warped distribution. A prompt of 2
    tokens makes the call's first round the prefill's; the rounds after it are replays, some of
    whose tokens fall in the window (K=3: the first round commits at most 4). The registry's fixed
    K=3 over graphs generates 4 tokens, too few for a replay of K=3 after the first round: here K=1 and
    K=3 rounds are replayed inside the window."""
    graphs_on(device)
    draft, target = _pair6()
    expected = exact_distribution(target, PROMPT, 3, sampling, eos)
    decoder = SpeculativeDecoder(draft.to(device), copy.deepcopy(target).to(device), policy(), sampling, fast="graphs")
    g = torch.Generator().manual_seed(1234)
    seqs, replayed, accepted = [], 0, 0
    for _ in range(1200):
        out = decoder.generate(torch.tensor([PROMPT], device=device), generator=g, eos_token_id=eos, max_new_tokens=6)
        seqs.append(tuple(out.tokens[0, len(PROMPT): len(PROMPT) + 3].tolist()))
        replayed += out.stats.replayed_rounds
        accepted += sum(out.stats.accept_lengths)
    assert chi_square_pvalue(seqs, expected) > 1e-4
    assert replayed > 600
    if decoder.policy.max_candidates:
        assert accepted > 300


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)],
                         ids=["greedy", "T1"])
def test_caches_after_replayed_rounds_equal_fresh_prefill(graphs_on, device, sampling):  # noqa: F811
    graphs_on(device)
    draft, target, _ = pair32(device)
    decoder = SpeculativeDecoder(draft, target, FixedK(3), sampling, fast="graphs")
    out = decoder.generate(torch.tensor([[3, 1, 4]], device=device), 40, generator=torch.Generator().manual_seed(3),
                           return_caches=True)
    tokens, s = out.tokens[0], out.stats
    assert s.replayed_rounds > 5 and min(s.accept_lengths) < 3  # replays with rejections
    for role, model in (("target", target), ("draft", draft)):
        cache = out.caches[role]
        length = cache.get_seq_length()
        assert length == len(tokens) - 1 if role == "target" else len(tokens) - 2 <= length <= len(tokens) - 1
        assert_cache_is_fresh_prefill(model, cache, tokens, length)


class HostOnly(StopPolicy):
    """A policy without ``stop_rows``: it decides on the host, one row at a time."""

    name, max_candidates, needs_hidden = "host_only", 3, False

    def should_stop(self, k, logits, hidden, token=None) -> bool:
        return k >= 2 or float(logits.max()) > 1e9


def test_rounds_not_captured_where_they_cannot_be(graphs_on):  # noqa: F811
    """A policy that decides only on the host, logits hooks, profile=True and capture_rounds=False
    decode round by round (same greedy tokens); so does the static backend."""
    graphs_on("cpu")
    draft, target, _ = pair32("cpu")
    greedy, prompt = SamplingConfig(temperature=0), torch.tensor([[1, 2, 3]])
    ref = SpeculativeDecoder(draft, target, FixedK(3), greedy, fast="graphs").generate(prompt, 12).tokens
    cases = [(SpeculativeDecoder(draft, target, HostOnly(), greedy, fast="graphs"), None),
             (SpeculativeDecoder(draft, target, FixedK(3), greedy, fast="graphs"),
              CallHooks(target_logits=lambda rows, tokens, ends, logits: logits)),
             (SpeculativeDecoder(draft, target, FixedK(3), greedy, fast="graphs", profile=True), None),
             (SpeculativeDecoder(draft, target, FixedK(3), greedy, fast="graphs", capture_rounds=False), None),
             (SpeculativeDecoder(draft, target, FixedK(3), greedy, fast="static"), None)]
    for decoder, hooks in cases:
        out = decoder.generate(prompt, 12, hooks=hooks)
        assert out.stats.replayed_rounds == 0
        assert out.tokens.tolist() == ref.tolist()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
def test_replayed_rounds_over_compiled_steps_equal_target_greedy(graphs_on):  # noqa: F811
    """fast='compile-graphs' (the fake capture on a CPU): a round graph holds each bucket's compiled
    step, compiled once and never recompiled (dynamo's error_on_recompile): the round's forwards, at a
    device-side position with a gathered mask, and the end-of-call rounds' per-forward graphs, with a
    slice of the causal mask, pass the same guards."""
    import torch._dynamo
    graphs_on("cpu")
    draft, target, cpu_target = pair32("cpu")
    decoder = SpeculativeDecoder(draft, target, FixedK(3), SamplingConfig(temperature=0), fast="compile-graphs")
    compiled = []
    for prompt, n in (([1, 2, 3], 21), ([4, 4, 9, 10, 11, 3, 5], 16)):
        ref = cpu_target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = decoder.generate(torch.tensor([prompt]), max_new_tokens=n)
        assert out.tokens.tolist() == ref.tolist() and out.stats.replayed_rounds > 2
        compiled.append(sorted(model_steps(target).compile_seconds))
    assert any(key[0] == 4 for key in compiled[0])  # the verification's bucket, compiled
    assert compiled[1] == compiled[0] and len(rounds_captured(target)) == 1  # nothing compiled or captured again


def test_a_replayed_round_refuses_invalid_draft_rows(graphs_on):  # noqa: F811
    """A round graph checks the draft's rows q on the device and the host raises sample's ValueError
    after the replay: here the draft's output layer turns NaN after the round graph was captured."""
    from specdecpp.core.sampling import INVALID_PROBS
    from specdecpp.decoders.captured import round_graphs
    from specdecpp.decoders.rounds import TokenBuffer

    graphs_on("cpu")
    draft, target, _ = pair32("cpu")
    sampling = SamplingConfig(temperature=1.0)
    decoder = SpeculativeDecoder(draft, target, FixedK(2), sampling, fast="graphs")
    prompt = torch.tensor([[1, 2, 3]])
    assert decoder.generate(prompt, 12, generator=torch.Generator().manual_seed(0)).stats.replayed_rounds > 0
    (graph,) = round_graphs(target)
    seq = TokenBuffer(prompt, 12, None, torch.device("cpu"))
    graph.bind(seq)
    k, n_acc, token, drafts = graph.run(seq, 2, torch.Generator().manual_seed(1))  # valid rows: a verdict
    assert k == 2 and 0 <= n_acc <= 2 and len(drafts) == 2 and 0 <= token < 32
    with torch.no_grad():
        draft.lm_head.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match=INVALID_PROBS.split(":")[0]):
        graph.run(seq, 2, torch.Generator().manual_seed(1))


# Adaptive policies (specdecpp.decoders.captured.StepGraphs): one graph per candidate, the policy's
# stop_rows deciding on the device, and one per K for the verdict.
ADAPTIVE = [pytest.param(lambda heads: SVIP(threshold=heads.get("svip", 0.33), max_candidates=4), id="svip"),
            pytest.param(lambda heads: SpecDecPP(heads["paper"], 0.5, max_candidates=4), id="paper_head"),
            pytest.param(lambda heads: SpecDecPP(heads["next"], 0.5, max_candidates=4), id="lag_free_head")]


def heads32(draft):
    with torch.random.fork_rng():
        torch.manual_seed(1)
        heads = {"paper": AcceptanceHead(32, 2), "next": NextTokenHead(32, 1)}
    # SVIP's threshold where its stop varies on this pair (0.33 stops after every first candidate)
    return {"svip": 0.6, **{k: h.to(next(draft.parameters()).device) for k, h in heads.items()}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ADAPTIVE)
def test_captured_steps_decide_as_the_host_does(graphs_on, device, policy):  # noqa: F811
    """Greedy, an adaptive policy's captured candidates stop where the round-by-round drafter stops
    (the same candidate lengths, round for round: the policy's decision and its round state on the
    device are the host's), and the output is the target's own greedy decoding."""
    graphs_on(device)
    draft, target, cpu_target = pair32(device)
    heads = heads32(draft)
    greedy = SamplingConfig(temperature=0)
    captured = SpeculativeDecoder(draft, target, policy(heads), greedy, fast="graphs")
    by_round = SpeculativeDecoder(draft, target, policy(heads), greedy, fast="static")
    lengths = set()
    for _ in range(2):
        for prompt, n, eos in itertools.product([[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]], (1, 6, 21), (None, 9)):
            ref = greedy_reference(cpu_target, prompt, n, eos)
            ids = torch.tensor([prompt], device=device)
            out = captured.generate(ids, max_new_tokens=n, eos_token_id=eos)
            host = by_round.generate(ids, max_new_tokens=n, eos_token_id=eos)
            assert out.tokens[0].cpu().tolist() == ref, (prompt, n, eos)
            assert out.stats.candidate_lengths == host.stats.candidate_lengths, (prompt, n, eos)
            if n == 21 and eos is None:
                # all but the prefill's and, with room for no candidate, the last
                assert out.stats.replayed_rounds >= len(out.stats.accept_lengths) - 2
            lengths.update(out.stats.candidate_lengths[1:])
    assert len(lengths - {0}) >= 2, lengths  # the stop really varies between replayed rounds


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ADAPTIVE)
def test_captured_steps_same_seed_same_output(graphs_on, device, policy):  # noqa: F811
    graphs_on(device)
    draft, target, _ = pair32(device)
    decoder = SpeculativeDecoder(draft, target, policy(heads32(draft)), SamplingConfig(temperature=1.0, top_k=10),
                                 fast="graphs")

    def run(seed):
        out = decoder.generate(torch.tensor([[1, 2]], device=device), 24, generator=torch.Generator().manual_seed(seed))
        assert out.stats.replayed_rounds >= len(out.stats.accept_lengths) - 2 > 3
        return out.tokens.tolist(), out.stats.accept_lengths, out.stats.candidate_lengths

    first = run(0)
    assert run(0) == first and run(1) != first


# An adaptive policy's replayed rounds have the target's distribution by the exactness registry's
# chain-{svip,paper_head,lag_free_head}-fast_graphs chi-square cases (test_exactness.py): the same decoders
# (these policies, its pair and centred heads), prompt, samplings and seed, over the fake capture, and with
# 4 new tokens 96-99% of their calls replay a round inside the 3-token window (200 calls of each, counted
# 2026-12-01). A test here that generated 6 instead sampled the same thing again (6 cases, 34-49 s each on
# a shared 2-core CPU).


@pytest.mark.parametrize("policy", [pytest.param(lambda: FixedK(3), id="k3"),
                                    pytest.param(lambda: SVIP(0.6, max_candidates=4), id="svip")])
def test_a_failed_round_capture_falls_back_to_rounds_one_by_one(graphs_on, monkeypatch, caplog, policy):  # noqa: F811
    """A round's capture that fails (a RuntimeError, as CUDA raises for an operation it cannot
    capture) is said once in a warning, and the call, and the decoder's later calls, go on round by
    round with the same greedy tokens."""
    from specdecpp.decoders import captured

    def fail(self, seq, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs_on("cpu")
    monkeypatch.setattr(captured.RoundGraph, "capture", fail)
    monkeypatch.setattr(captured.StepGraphs, "capture", fail)
    draft, target, cpu_target = pair32("cpu")
    decoder = SpeculativeDecoder(draft, target, policy(), SamplingConfig(temperature=0), fast="graphs")
    for prompt in ([1, 2, 3], [7]):
        out = decoder.generate(torch.tensor([prompt]), max_new_tokens=12)
        assert out.tokens[0].tolist() == greedy_reference(cpu_target, prompt, 12, None)
        assert out.stats.replayed_rounds == 0
    assert decoder.capture_rounds is False
    assert sum("decoding round by round" in r.getMessage() for r in caplog.records) == 1


def test_fused_rounds_need_compile_graphs():
    draft, target, _ = pair32("cpu")
    for fast in (None, "static", "compile"):
        with pytest.raises(ValueError, match="capture_rounds='fused' .* needs fast='compile-graphs'"):
            SpeculativeDecoder(draft, target, FixedK(3), fast=fast, capture_rounds="fused")
    with pytest.raises(ValueError, match="capture_rounds must be True, False or 'fused', got 'yes'"):
        SpeculativeDecoder(draft, target, FixedK(3), capture_rounds="yes")


def fused_rounds(target) -> list:
    """The captured rounds (whole or in steps) over ``target``'s buffers whose glue is compiled."""
    sets = model_steps(target).graph_sets.values()
    return [g for group in sets for graph_set in group for g in graph_set.rounds.values() if g.fused]


FUSED = [pytest.param(lambda heads: FixedK(3), id="k3"), pytest.param(lambda heads: TargetOnly(), id="target_only"),
         pytest.param(lambda heads: SVIP(0.6, max_candidates=3), id="svip"),
         pytest.param(lambda heads: SpecDecPP(heads["next"], 0.5, max_candidates=4), id="lag_free_head")]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", FUSED)
def test_fused_rounds_compile_their_glue_and_equal_target_greedy(graphs_on, device, policy):  # noqa: F811
    """capture_rounds='fused' (fast='compile-graphs'; the fake capture on a CPU): a captured round's draws
    and rule run as inductor-compiled functions (each a compiled callable, one per K for the rule), the
    rounds are replayed, and greedy output is the target's own; a second prompt compiles nothing again."""
    import torch._dynamo
    graphs_on(device)
    draft, target, cpu_target = pair32(device)
    decoder = SpeculativeDecoder(draft, target, policy(heads32(draft)), SamplingConfig(temperature=0),
                                 fast="compile-graphs", capture_rounds="fused")
    for i, (prompt, n) in enumerate((([1, 2, 3], 21), ([4, 4, 9, 10, 11, 3, 5], 16))):
        ref = cpu_target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        with torch._dynamo.config.patch(error_on_recompile=bool(i)):
            out = decoder.generate(torch.tensor([prompt], device=device), max_new_tokens=n)
        assert out.tokens.tolist() == ref.tolist() and out.stats.replayed_rounds > 2
    (graph,) = fused_rounds(target)
    assert hasattr(graph._draw, "_torchdynamo_orig_callable") and graph._rules
    assert all(hasattr(rule, "_torchdynamo_orig_callable") for rule in graph._rules.values())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", [FUSED[0], FUSED[3]])
def test_fused_rounds_have_the_target_distribution_and_same_seed_same_output(graphs_on, device, policy):  # noqa: F811
    """Sampled (T=1), fused: the first 3 of 6 tokens follow the target's exact distribution (chi-square
    against enumeration; the dense top-k and draw a compiled region takes on a CPU too), and a seed
    gives the same output again. A whole round (K=3) and an adaptive one (the lag-free head): what is
    compiled, the draw and the rule per K, is the same under SVIP, whose stop decision runs uncompiled
    (SVIP's fused rounds: the greedy test above)."""
    from tests.decoders.test_exactness import _heads

    graphs_on(device)
    draft, target = _pair6()
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_distribution(target, PROMPT, 3, sampling, None)
    heads = {k: h.to(device) for k, h in _heads(draft).items()}
    decoder = SpeculativeDecoder(copy.deepcopy(draft).to(device), copy.deepcopy(target).to(device), policy(heads),
                                 sampling, fast="compile-graphs", capture_rounds="fused")

    def run(g):
        out = decoder.generate(torch.tensor([PROMPT], device=device), generator=g, max_new_tokens=6)
        return tuple(out.tokens[0, len(PROMPT): len(PROMPT) + 3].tolist()), out.stats.replayed_rounds

    g = torch.Generator().manual_seed(1234)
    runs = [run(g) for _ in range(1200)]
    assert chi_square_pvalue([seq for seq, _ in runs], expected) > 1e-4
    assert sum(r for _, r in runs) > 600
    assert run(torch.Generator().manual_seed(7)) == run(torch.Generator().manual_seed(7))
