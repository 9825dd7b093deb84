"""fast='graphs' (specdecpp.fast.graphs: CUDA graphs per bucket over leased KV buffers). On CUDA
(marked ``gpu``) the real capture; on the CPU the same bookkeeping with :func:`capture_graph`
replaced by a fake that keeps a CUDA graph's rules (tests/helpers/graph_tape.py: a replay re-executes
the operations recorded at capture on the same tensors and rewrites the captured outputs in place,
so a runner that handed out uncloned outputs, or code that decided on the host at capture, fails
here; a capture refuses host reads, value-dependent shapes and random draws): the logits equal the static and
dynamic runners' after random feeds, rollbacks and compactions (one row and batches), each bucket
is captured once per process and never again after a warm-up, a second live runner gets buffers
of its own, and 'graphs' is refused on a CPU with the device named."""

from __future__ import annotations

import random

import pytest
import torch

from specdecpp.decoders.batch import BatchRunner
from specdecpp.fast import buckets
from specdecpp.fast.batch_runner import StaticBatchRunner
from specdecpp.fast.calls import CallRunners
from specdecpp.fast.graphs import stage_inputs
from specdecpp.fast.runners import StaticRunner
from specdecpp.fast.step import model_steps
from specdecpp.models.runner import ModelRunner
from tests.helpers import graph_tape
from tests.helpers.tiny import tiny_lm
from tests.models.test_static_batch_runner import run_random
from tests.models.test_static_runner import MAX_LEN, VOCAB, on, run_both

DEVICES = [pytest.param("cpu", id="cpu-fake"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def graphs_on(monkeypatch):
    """``graphs_on(device)``: the device's model setup for fast='graphs' (the fake on a CPU)."""
    def setup(device: str) -> None:
        if device == "cpu":
            graph_tape.install(monkeypatch)
    return setup


def fresh(device: str, seed: int = 5):
    return on(device, tiny_lm(VOCAB, 32, 2, seed=seed, scale=0.6))  # a model of its own: its captures start at 0


def test_graphs_refused_on_cpu():
    model = tiny_lm(VOCAB, 32, 2, seed=5, scale=0.6)
    for build in (lambda: StaticRunner(model, VOCAB, want_hidden=False, fast="graphs"),
                  lambda: StaticBatchRunner(model, VOCAB, want_hidden=False, fast="graphs"),
                  lambda: CallRunners("graphs", (model,))(64)(model, VOCAB, False)):
        with pytest.raises(ValueError, match="fast='graphs' needs CUDA; the models are on cpu"):
            build()
    assert buckets.check_fast("infer", "graphs") == "graphs"  # the device not known yet: checked when models load


def test_the_cpu_fake_keeps_a_cuda_graphs_rules():
    """tests/helpers/graph_tape.py: a replay re-executes the recorded operations on the same tensors
    (new input values are seen; Python that ran at capture is not rerun, so a host-side decision stays
    as captured); the outputs hold garbage until the first replay; a capture refuses a host read, a
    value-dependent shape and a random draw, and takes attention without dropout."""
    x, scale, calls = torch.ones(4), [2.0], []

    def run():
        calls.append(1)
        return ((x * scale[0]).cumsum(0), x[1:].clone())

    replay, (out, tail) = graph_tape.fake_capture(run, None, warmup=1)
    assert len(calls) == 2 and torch.isnan(out).all()  # a warm-up and the capture; nothing written yet
    x.copy_(torch.arange(4.0))
    scale[0] = 10.0  # a host value read at capture: a replay keeps 2.0
    replay()
    assert out.tolist() == [0.0, 2.0, 6.0, 12.0] and tail.tolist() == [1.0, 2.0, 3.0] and len(calls) == 2
    refused = {"on the host": lambda: (x * int(x.sum()),), "shape depends on values": lambda: (x.nonzero(),),
               "draws random numbers": lambda: (torch.rand(3),)}
    for what, fn in refused.items():
        with pytest.raises(graph_tape.CaptureRefused, match=what):
            graph_tape.fake_capture(fn, None, warmup=1)
    q = torch.randn(1, 2, 3, 4)
    replay, (att,) = graph_tape.fake_capture(lambda: (torch.nn.functional.scaled_dot_product_attention(q, q, q),),
                                             None)
    replay()
    assert torch.equal(att, torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_stage_inputs_checks_shape_and_dtype():
    dst = (torch.zeros(4, dtype=torch.long), torch.zeros(1, 1, 4, 8))
    stage_inputs(dst, (torch.arange(4), torch.ones(1, 1, 4, 8)))
    assert dst[0].tolist() == [0, 1, 2, 3] and bool((dst[1] == 1).all())
    with pytest.raises(ValueError, match="input 0 of a captured step is \\(2,\\) torch.int64; the graph was captured "
                       "for \\(4,\\)"):
        stage_inputs(dst, (torch.arange(2), torch.ones(1, 1, 4, 8)))
    with pytest.raises(ValueError, match="input 1 .* torch.float16"):
        stage_inputs(dst, (torch.arange(4), torch.ones(1, 1, 4, 8, dtype=torch.float16)))
    with pytest.raises(ValueError, match="takes 2 inputs, got 1"):
        stage_inputs(dst, (torch.arange(4),))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_graphs_match_the_static_and_dynamic_runners(graphs_on, device, seed):
    graphs_on(device)
    model = fresh(device)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    runners = [ModelRunner(model, VOCAB, want_hidden=True),
               StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN),
               StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, fast="graphs"),
               StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, buckets=(1, 2), fast="graphs")]
    with runners[0]:
        run_both(rng, model, runners, device, steps=40)
    steps = model_steps(model)
    assert steps.captures == len(steps.capture_seconds) > 0
    assert {len(s) for s in steps.graph_sets.values()} == {1}  # two live runners of two sizes: a set each
    assert runners[2].cache.keys[0].data_ptr() == runners[2].graph_set.keys[0].data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_graph_outputs_are_cloned(graphs_on, device):
    """Logits handed out survive the next replay of the same bucket (the graph's outputs do not)."""
    graphs_on(device)
    model = fresh(device)
    runner = StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, buckets=(1, 2), fast="graphs")
    first, first_hidden = runner.feed(torch.tensor([3], device=device))
    kept, kept_hidden = first.clone(), first_hidden.clone()
    runner.feed(torch.tensor([9], device=device))
    torch.testing.assert_close(first, kept, atol=0, rtol=0)
    torch.testing.assert_close(first_hidden, kept_hidden, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_each_bucket_captured_once_then_never(graphs_on, device):
    """warm_up captures every bucket once; later runners (one at a time) lease the same buffers and
    graphs and capture nothing, across every bucket; a second live runner gets a set of its own."""
    graphs_on(device)
    model = fresh(device)
    runners = CallRunners("graphs", (model,))
    runners.warm_up(40, [(model, (1, 2, 4))])
    steps = model_steps(model)
    assert steps.captures == 3
    for seed in (0, 1):
        graph_runner = runners(40, (1, 2, 4))(model, VOCAB, True)
        ref = StaticRunner(model, VOCAB, want_hidden=True, max_len=graph_runner.max_len, buckets=(1, 2, 4))
        run_both(random.Random(seed), model, [ref, graph_runner], device, steps=30)
        del graph_runner
    assert steps.captures == 3
    held = runners(40, (1, 2, 4))(model, VOCAB, True)
    other = runners(40, (1, 2, 4))(model, VOCAB, True)
    assert other.graph_set is not held.graph_set
    other.feed(torch.zeros(2, dtype=torch.long, device=device))
    assert steps.captures == 4


@pytest.mark.parametrize("device", DEVICES)
def test_a_runner_kept_only_by_a_reference_cycle_frees_its_set(graphs_on, device):
    """A dropped runner that a reference cycle still keeps in memory (the frames of a caught
    exception's traceback hold the runner whose forward raised) is not live: the next runner leases
    its set, buffers and captures, with the automatic collector off, and captures nothing again."""
    import gc

    graphs_on(device)
    model = fresh(device)
    runners = CallRunners("graphs", (model,))
    steps = model_steps(model)
    gc.collect()
    gc.disable()
    try:
        first = runners(40, (1, 2))(model, VOCAB, False)
        first.feed(torch.zeros(2, dtype=torch.long, device=device))
        held, captures = first.graph_set, steps.captures
        first.cycle = [first]  # alive until a collection
        del first
        assert not held.free()
        second = runners(40, (1, 2))(model, VOCAB, False)
        assert second.graph_set is held and len(steps.graph_sets[(1, held.size, second.dtype)]) == 1
        second.feed(torch.zeros(2, dtype=torch.long, device=device))
        assert steps.captures == captures
    finally:
        gc.enable()


@pytest.mark.parametrize("device", DEVICES)
def test_warm_up_shows_its_steps(graphs_on, device, capsys):
    """warm_up(progress=True): a bar over every (model, width) step, and with ``rows`` every (model,
    batch, width) step, each counted once it is captured; progress=False prints nothing."""
    graphs_on(device)
    model, other = fresh(device), fresh(device, seed=6)
    runners = CallRunners("graphs", (model, other))
    runners.warm_up(40, [(model, (1, 2, 4)), (other, (1, 2))], progress=True)
    err = capsys.readouterr().err
    assert "fast=graphs: capturing steps" in err and "5/5" in err
    assert model_steps(model).captures == 3 and model_steps(other).captures == 2
    runners.warm_up(40, [(model, (1, 2))], rows=3, progress=True)  # batch buckets 1, 2, 4 x widths 1, 2
    err = capsys.readouterr().err
    assert "6/6" in err and "batch 4 width 2" in err
    runners.warm_up(40, [(model, (1, 2, 4))])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_batch_graphs_match_the_eager_batch_runner(graphs_on, device, seed):
    graphs_on(device)
    model = fresh(device)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    runners = [BatchRunner(model, VOCAB, want_hidden=True),
               StaticBatchRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, rows=3, fast="graphs")]
    with runners[0]:
        run_random(rng, runners, device, steps=60, max_rows=6)
    graph_runner, steps = runners[1], model_steps(model)
    assert graph_runner.capacity == 8 and graph_runner.graph_set.rows == 8
    assert graph_runner.keys[0].data_ptr() == graph_runner.graph_set.keys[0].data_ptr()
    assert graph_runner.n_moved_rows > 0 and steps.captures > 0
    assert steps.graph_sets[(4, graph_runner.size, graph_runner.dtype)][0].free()  # released when it grew


@pytest.mark.parametrize("device", DEVICES)
def test_batch_buckets_captured_once_after_warm_up(graphs_on, device):
    graphs_on(device)
    model = fresh(device)
    runners = CallRunners("graphs", (model,))
    runners.warm_up(40, [(model, (1, 2))], rows=2)
    steps = model_steps(model)
    assert steps.captures == 4  # batches 1, 2 x widths 1, 2
    for seed in (0, 1):
        ref = BatchRunner(model, VOCAB, want_hidden=True)
        graph_runner = runners.batch(40, (1, 2), rows=2)(model, VOCAB, True)
        with ref:
            run_random(random.Random(seed), [ref, graph_runner], device, steps=30, max_rows=2)
        del graph_runner
    assert steps.captures == 4


@pytest.mark.parametrize("name", ["chain-fixed_k3", "chain-svip", "sequoia-two_level", "batch-fixed_k3"])
def test_decoders_on_fake_graphs_equal_greedy_and_capture_once(graphs_on, name):
    """The registry's decoders with fast='graphs' (the fake capture on a CPU): greedy output equals
    the target's own, and a second round of calls captures nothing new."""
    from specdecpp import SamplingConfig
    from tests.decoders.test_exactness import DECODERS
    from tests.helpers.tiny import noisy_copy

    graphs_on("cpu")
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    draft = noisy_copy(target, 0.3, seed=6)
    decoder = DECODERS[f"{name}-fast_graphs"](draft, target, SamplingConfig(temperature=0), {})
    counts = []
    for _ in range(2):
        for prompt, n in ((1, 2, 3), 21), ((4, 4, 9, 10, 11, 3, 5), 6):
            ref = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
            assert decoder.generate(torch.tensor([prompt]), max_new_tokens=n).tokens.tolist() == ref.tolist()
        counts.append((model_steps(target).captures, model_steps(draft).captures))
    assert counts[0][0] > 0 and counts[1] == counts[0]


@pytest.mark.parametrize("device", DEVICES)
def test_a_returned_cache_keeps_its_buffers_from_later_calls(graphs_on, device):
    """generate(return_caches=True) under fast='graphs': the caches it returns hold what the call's
    graph sets held at its end (the valid slots equal an eager call's caches) in buffers of their own,
    so a later call, which leases the same sets (one per model), leaves them as they were."""
    from specdecpp import SamplingConfig
    from tests.decoders.test_exactness import DECODERS
    from tests.helpers.tiny import noisy_copy

    graphs_on(device)
    target = on(device, tiny_lm(32, 32, 2, seed=5, scale=0.4))
    draft = on(device, noisy_copy(target, 0.3, seed=6))
    greedy, prompt = SamplingConfig(temperature=0), torch.tensor([[1, 2, 3]], device=device)
    decoder = DECODERS["chain-fixed_k3-fast_graphs"](draft, target, greedy, {})
    out = decoder.generate(prompt, max_new_tokens=5, return_caches=True)
    eager = DECODERS["chain-fixed_k3"](draft, target, greedy, {}).generate(prompt, max_new_tokens=5, return_caches=True)
    assert torch.equal(out.tokens, eager.tokens)
    sets = {role: model_steps(m).graph_sets for role, m in (("target", target), ("draft", draft))}
    kept = {}
    for role, cache in out.caches.items():
        (graph_set,), = sets[role].values()
        assert cache.keys[0].data_ptr() != graph_set.keys[0].data_ptr()
        assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, graph_set.keys + graph_set.values,
                                                    strict=True))
        layer = eager.caches[role].layers[0]
        n = cache.length
        assert n == layer.keys.shape[-2] and torch.allclose(cache.keys[0][..., :n, :], layer.keys, atol=1e-5), role
        kept[role] = [k.clone() for k in cache.keys + cache.values]
    decoder.generate(torch.tensor([[7, 9, 11, 4]], device=device), max_new_tokens=5)
    for role, cache in out.caches.items():
        assert [len(v) for v in sets[role].values()] == [1], role
        assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, kept[role], strict=True)), role


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
@pytest.mark.parametrize("device", DEVICES)
def test_compile_graphs_compile_then_capture_each_bucket_once(graphs_on, device):
    """fast='compile-graphs': each bucket's step compiles once, whole (no graph break), and its compiled
    step is what the graph captures; the compile's own time is kept (the capture's warm-ups call the
    compiled step again); random feeds, rollbacks and compactions then agree with the eager static and
    dynamic runners, on this and a later runner, and nothing recompiles or is captured again."""
    from torch._dynamo.utils import counters

    graphs_on(device)
    model = fresh(device, seed=8)
    buckets = (1, 2, 4)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    runners = CallRunners("compile-graphs", (model,))
    runners.warm_up(40, [(model, buckets)])
    steps = model_steps(model)
    size = runners.size
    assert counters["stats"]["unique_graphs"] - graphs == len(buckets)
    assert set(steps.compile_seconds) == {(n, size) for n in buckets}
    assert set(steps.capture_seconds) == {("compile-graphs", n, size) for n in buckets} and steps.captures == 3
    for n in buckets:  # the first warm-up compiled; the capture's time leaves that out, and compiling takes longer
        assert 0 < steps.capture_seconds[("compile-graphs", n, size)] < steps.compile_seconds[(n, size)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (0, 1):
            graph_runner = runners(40, buckets)(model, VOCAB, True)
            assert graph_runner.cache.keys[0].data_ptr() == graph_runner.graph_set.keys[0].data_ptr()
            refs = [ModelRunner(model, VOCAB, want_hidden=True),
                    StaticRunner(model, VOCAB, want_hidden=True, max_len=graph_runner.max_len, buckets=buckets)]
            with refs[0]:
                run_both(random.Random(seed), model, [*refs, graph_runner], device, steps=30)
            del graph_runner
    assert steps.captures == 3 and counters["stats"]["unique_graphs"] - graphs == len(buckets)
    assert sum(counters["graph_break"].values()) == breaks


def test_compile_graphs_refused_on_cpu():
    model = tiny_lm(VOCAB, 32, 2, seed=5, scale=0.6)
    with pytest.raises(ValueError, match="fast='compile-graphs' needs CUDA; the models are on cpu"):
        StaticRunner(model, VOCAB, want_hidden=False, fast="compile-graphs")
    with pytest.raises(ValueError, match="fast='compile-graphs' needs CUDA; the models are on cpu"):
        CallRunners("compile-graphs", (model,))(64)(model, VOCAB, False)
