"""fast="compile"'s inductor settings (specdecpp.fast.compiling.COMPILE_OPTIONS): chosen by name or
as a mapping, handed to ``torch.compile`` with ``freezing`` in force while the first call traces;
and (slow) the tuned CPU settings on tiny float32 Llamas: the one-row and the batch runner agree
with the eager runners through random feeds, never recompile, and hold the weights they were
compiled with (freezing took effect). The rest of the suite compiles with the plain settings
(tests/conftest.py)."""

# ruff: noqa: F811 (test arguments named as the fixture imported from test_static_runner)
from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.utils import counters

from specdecpp.decoders.batch import BatchRunner
from specdecpp.fast import compiling, torch_internals
from specdecpp.fast.calls import CallRunners
from specdecpp.fast.compiling import (
    COMPILE_OPTIONS,
    NO_GEMM_CHOICE,
    TUNED_COMPILE_OPTIONS,
    compiled_step,
    narrow_options,
    set_compile_options,
    with_aten_gemms,
)
from specdecpp.fast.runners import StaticRunner
from specdecpp.fast.step import ModelSteps, model_steps, static_step
from specdecpp.models.runner import ModelRunner
from tests.helpers.tiny import tiny_lm
from tests.models.test_static_batch_runner import run_random
from tests.models.test_static_runner import (
    COMPILED_SIZE,
    COMPILED_VOCAB,
    DEVICES,
    MAX_LEN,
    VOCAB,
    close,
    on,
    run_both,
)


@pytest.fixture
def restore_options():
    before = {k: dict(v) for k, v in COMPILE_OPTIONS.items()}
    yield
    COMPILE_OPTIONS.clear()
    COMPILE_OPTIONS.update(before)


def test_options_by_name_or_mapping(restore_options):
    assert TUNED_COMPILE_OPTIONS["cpu"]["freezing"] is True and TUNED_COMPILE_OPTIONS["cpu"]["max_autotune"] is True
    assert set_compile_options("tuned") == TUNED_COMPILE_OPTIONS["cpu"] == COMPILE_OPTIONS["cpu"]
    assert set_compile_options("plain") == {} == COMPILE_OPTIONS["cpu"]
    assert set_compile_options(None) == TUNED_COMPILE_OPTIONS["cpu"]  # null in a config: the default
    assert set_compile_options({"freezing": True}, "cuda") == {"freezing": True} == COMPILE_OPTIONS["cuda"]
    assert COMPILE_OPTIONS["cpu"] == TUNED_COMPILE_OPTIONS["cpu"]  # one device type at a time
    for bad in ("fastest", 3, ["freezing"]):
        with pytest.raises(ValueError, match="compile_options must be 'tuned', 'plain' or a dict"):
            set_compile_options(bad)


def options_of(compile_kwargs: dict):
    """The inductor options a torch.compile call was given: ``options=``, or those of the project's
    inductor backend (torch_internals.keeping_backend)."""
    backend = compile_kwargs.get("backend")
    return compile_kwargs.get("options") if backend is None else backend.options


@pytest.mark.parametrize("choice", ["tuned", "plain"])
def test_compiled_step_compiles_with_the_options_in_force(monkeypatch, restore_options, choice):
    """What reaches torch.compile, and that ``freezing`` is set while the first call traces (dynamo
    reads it from inductor's config, not from ``options=``) and only then."""
    import torch._inductor.config as inductor_config

    seen = {}

    def fake_compile(fn, **kwargs):
        seen.update({k: v for k, v in kwargs.items() if k != "backend"}, name=fn.__name__, options=options_of(kwargs))

        def run(*args):
            seen.setdefault("freezing_in_calls", []).append(inductor_config.freezing)
            seen.setdefault("guards_skipped", []).append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)
            return args

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    set_compile_options(choice)
    steps = ModelSteps()
    step = compiled_step(tiny_lm(VOCAB, 32, 2, seed=1), static_step, (1, 64), "static_step_w1_s64", steps)
    assert step(1, 2) == (1, 2) and steps.compiled[(1, 64)](3) == (3,)  # the second call: the compiled fn itself
    assert (1, 64) in steps.compile_seconds and seen["name"] == "static_step_w1_s64"
    assert seen["fullgraph"] is True and seen["dynamic"] is False
    # a one-row bucket under the tuned settings: the C++ GEMM template alone (narrow_options)
    tuned_narrow = {**TUNED_COMPILE_OPTIONS["cpu"], "max_autotune_gemm_backends": "CPP"}
    del tuned_narrow["narrow_gemm_rows"]
    assert seen["options"] == (tuned_narrow if choice == "tuned" else None)
    assert seen["freezing_in_calls"] == [choice == "tuned", False]
    assert inductor_config.freezing is False
    # the compiling call evaluates dynamo's guards, later calls skip them, unless recompiles are being checked
    with torch._dynamo.config.patch(error_on_recompile=True):
        step(4)
    assert seen["guards_skipped"] == [False, True, False]
    assert torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe is False  # the stance is put back
    monkeypatch.setattr(compiling, "CAN_SKIP_GUARDS", False)  # a torch before 2.6: every guard
    step(5)
    assert seen["guards_skipped"] == [False, True, False, False]
    mine = compiled_step(tiny_lm(VOCAB, 32, 2, seed=1), static_step, (2, 64), "w2", ModelSteps(),
                         options={"max_autotune": True})  # a runner's own options win over the default
    mine()
    assert seen["options"] == {"max_autotune": True} and seen["freezing_in_calls"][-1] is False


def test_narrow_buckets_get_the_template_alone_and_aten_is_added_back_only_where_missing():
    tuned = TUNED_COMPILE_OPTIONS["cpu"]
    assert tuned["max_autotune_gemm_backends"] == "CPP,ATEN" and tuned["narrow_gemm_rows"] == 4
    inductors = {k: v for k, v in tuned.items() if k != "narrow_gemm_rows"}  # the project's key never reaches torch
    for rows in (1, 2, 4):
        assert narrow_options(tuned, rows) == {**inductors, "max_autotune_gemm_backends": "CPP"}
    for rows in (5, 8, 32):
        assert narrow_options(tuned, rows) == inductors
    mine = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    assert narrow_options(mine, 1) == mine and narrow_options({}, 1) == {}  # a mapping without the key: as it is
    assert narrow_options({**mine, "narrow_gemm_rows": 2}, 2)["max_autotune_gemm_backends"] == "CPP"
    assert narrow_options({**mine, "narrow_gemm_rows": 2}, 4) == mine
    assert tuned["narrow_gemm_rows"] == 4  # not changed by the calls
    assert with_aten_gemms(narrow_options(tuned, 1)) == inductors
    assert with_aten_gemms({"max_autotune": True, "max_autotune_gemm_backends": "cpp, triton"})[
        "max_autotune_gemm_backends"] == "CPP,TRITON,ATEN"
    for has_aten in ({}, {"freezing": True}, {"max_autotune": True}, inductors,  # inductor's defaults hold ATen
                     {"max_autotune": False, "max_autotune_gemm_backends": "CPP"}):
        assert with_aten_gemms(has_aten) is None


def test_bucket_rows_choose_the_backends_and_a_gemm_without_a_kernel_compiles_again_with_aten(
        monkeypatch, restore_options, caplog):
    """Rows are width x batch; where the template alone leaves a matrix product without a kernel, inductor
    raises "No choices to select" and the bucket compiles again with ATen beside the template, once, and
    says so; any other compile error is raised as it is."""
    calls = []

    def fake_compile(fn, **kwargs):
        backends = options_of(kwargs)["max_autotune_gemm_backends"]
        calls.append(backends)

        def run(*args):
            if backends == "CPP" and args == ("float64",):
                raise RuntimeError(f"LoweringException: NoValidChoicesError: {NO_GEMM_CHOICE}. Provided reason: "
                                   "No choices exist for backend.")
            return args

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    set_compile_options("tuned")
    model = tiny_lm(VOCAB, 32, 2, seed=1)
    steps = ModelSteps()
    for key in ((4, 64), (8, 64), (2, 64, 2), (2, 64, 4)):
        compiled_step(model, static_step, key, f"step_{key}", steps)()
    assert calls == ["CPP", "CPP,ATEN", "CPP", "CPP,ATEN"]
    calls.clear()
    with caplog.at_level("WARNING", logger="specdecpp.fast"):
        step = compiled_step(model, static_step, (1, 128), "static_step_w1_s128", steps)
        assert step("float64") == ("float64",) and steps.compiled[(1, 128)]("float64") == ("float64",)
    assert calls == ["CPP", "CPP,ATEN"]  # one fallback compile, kept for later calls
    assert "static_step_w1_s128" in caplog.text and "ATen" in caplog.text and (1, 128) in steps.compile_seconds

    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("something else went wrong")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(RuntimeError, match="something else"):
        compiled_step(model, static_step, (2, 128), "w2", ModelSteps())()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
def test_tuned_settings_match_eager_never_recompile_and_freeze_the_weights(restore_options, capfd, recwarn):
    """The CPU's tuned settings (CUDA has none: its compiled steps are covered by the suite's compile tests)."""
    device = "cpu"
    set_compile_options("tuned", "cpu")
    model = on(device, tiny_lm(VOCAB, 32, 2, seed=7, scale=0.6))  # fresh: its steps compile here
    buckets = (1, 2)
    compiled = StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, buckets=buckets, fast="compile")
    for n in buckets:
        compiled.feed(torch.zeros(n, dtype=torch.long, device=device))
    assert set(model_steps(model).compile_seconds) == {(n, compiled.cache.size) for n in buckets}
    assert "AUTOTUNE" not in capfd.readouterr().err  # inductor's per-GEMM output stays quiet
    assert not [w for w in recwarn if "TypedStorage" in str(w.message)]
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled.rollback(0)
        ref = ModelRunner(model, VOCAB, want_hidden=True)
        with ref:
            run_both(random.Random(3), model, [ref, compiled], device, steps=25)
        # the batch runner's (batch, width) buckets under the same settings
        runners = CallRunners("compile", (model,))
        assert runners.warm_up(MAX_LEN - 4, [(model, buckets)], rows=2) > 0
        batch = [BatchRunner(model, VOCAB, want_hidden=True),
                 runners.batch(MAX_LEN - 4, buckets, 2)(model, VOCAB, True)]
        with batch[0]:
            run_random(random.Random(4), batch, device, steps=25, max_rows=2)
    assert counters["stats"]["unique_graphs"] - graphs == 4  # the batch buckets (1, 2) x (1, 2), nothing else
    assert sum(counters["graph_break"].values()) == breaks
    # freezing: the compiled step holds the weights it was compiled with (docs/engine.md, "Frozen weights")
    ids = torch.tensor([3], device=device)
    fresh = StaticRunner(model, VOCAB, want_hidden=False, max_len=MAX_LEN, buckets=buckets, fast="compile")
    before = fresh.feed(ids)[0]
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2.0)
    fresh.rollback(0)
    still = fresh.feed(ids)[0]
    eager = StaticRunner(model, VOCAB, want_hidden=False, max_len=MAX_LEN, buckets=buckets, fast="static").feed(ids)[0]
    torch.testing.assert_close(still, before)
    assert not torch.allclose(eager, before, atol=1e-3)


@pytest.mark.slow
def test_a_compiled_step_without_its_guards_agrees_and_refuses_a_recompile(restore_options):
    """After its compile a step runs under dynamo's ``skip_guard_eval_unsafe`` (docs/engine.md, "Guards"):
    its logits are those of the same call with every guard evaluated, and a call that would need another
    graph (autograd on, where the step compiled with it off) is refused with an error, not run on the
    wrong graph; nothing compiles again."""
    set_compile_options("plain")
    model = tiny_lm(COMPILED_VOCAB, 32, 2, seed=11)  # the compiled tests' model and cache (test_static_runner.py)
    runner = StaticRunner(model, COMPILED_VOCAB, want_hidden=False, max_len=COMPILED_SIZE - 1, buckets=(1,),
                          fast="compile")
    first = runner.feed(torch.tensor([5]))[0]  # the compile, under no_grad
    graphs = counters["stats"]["unique_graphs"]
    for token in (7, 9, 11):
        runner.rollback(1)
        skipped = runner.feed(torch.tensor([token]))[0]
        runner.rollback(1)
        with torch._dynamo.config.patch(error_on_recompile=True):  # every guard evaluated
            guarded = runner.feed(torch.tensor([token]))[0]
        torch.testing.assert_close(skipped, guarded, rtol=0, atol=0)
    runner.rollback(0)
    torch.testing.assert_close(runner.feed(torch.tensor([5]))[0], first, rtol=0, atol=0)
    slots, positions, mask = runner.chain_inputs(0, 1)
    args = (runner.decoder, runner.head, runner.cache_arg, runner.cache, torch.tensor([5]), positions, slots, mask)
    assert torch.is_grad_enabled()
    with runner.attention(), pytest.raises(RuntimeError, match="skip_guard_eval_unsafe"):
        runner.plain_step(1)(*args)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled again


@pytest.mark.slow
def test_a_float64_model_compiles_through_the_aten_fallback(restore_options, caplog):
    """Inductor's C++ GEMM template computes no float64 product: with the tuned settings a one-row bucket
    (the template alone) is refused by inductor, compiles again with ATen beside the template, says so,
    and gives the eager runner's logits."""
    set_compile_options("tuned")
    model = tiny_lm(VOCAB, 32, 2, seed=3).double()
    runner = StaticRunner(model, VOCAB, want_hidden=False, max_len=MAX_LEN, buckets=(1,), fast="compile")
    ref = ModelRunner(model, VOCAB, want_hidden=False)
    with caplog.at_level("WARNING", logger="specdecpp.fast"), ref, torch.no_grad():
        runner.feed(torch.tensor([3])), ref.feed(torch.tensor([3]))
        for token in (6, 9):
            torch.testing.assert_close(runner.feed(torch.tensor([token]))[0], ref.feed(torch.tensor([token]))[0],
                                       rtol=0, atol=1e-5)
    assert "compiling it again with ATen" in caplog.text
    assert len(model_steps(model).compile_seconds) == 1


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_step_is_called_without_dynamo_and_writes_each_runners_own_cache(restore_options, monkeypatch,
                                                                                    device):
    """After its compile a step calls inductor's graph directly (torch_internals.direct_call: no dynamo frame
    evaluation, no stance), matched to each call's own tensors: two runners sharing the compiled
    bucket each read and write their own cache and agree with the eager static runner through random
    feeds; a call under another global state (autograd on) goes through dynamo, which refuses it."""
    set_compile_options("plain", device)
    model = on(device, tiny_lm(COMPILED_VOCAB, 32, 2, seed=13))  # the compiled tests' model and cache
    stances = []
    real = torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: stances.append(k) or real(*a, **k))
    max_len = COMPILED_SIZE - 2
    runners = [StaticRunner(model, COMPILED_VOCAB, want_hidden=True, max_len=max_len, buckets=(1, 2), fast="compile",
                            cover=False) for _ in range(2)]
    eager = [StaticRunner(model, COMPILED_VOCAB, want_hidden=True, max_len=max_len, buckets=(1, 2), fast="static")
             for _ in range(2)]
    for r in runners:
        r.feed(torch.tensor([3, 4], device=device))
        r.feed(torch.tensor([5], device=device))  # both buckets compiled by the first runner, then used by both
    assert set(model_steps(model).compile_seconds) == {(1, runners[0].cache.size), (2, runners[0].cache.size)}
    stances.clear()
    for e in eager:
        e.feed(torch.tensor([3, 4, 5], device=device))
    rng = random.Random(5)
    for _ in range(40):
        i, n = rng.randrange(2), rng.choice([1, 2])
        ids = torch.randint(0, VOCAB, (n,), device=device)
        logits, hidden = runners[i].feed(ids, n_logits=n)
        ref_logits, ref_hidden = eager[i].feed(ids, n_logits=n)
        close(device, logits, ref_logits)
        close(device, hidden, ref_hidden)
        if rng.random() < 0.3:
            keep = rng.randint(1, runners[i].length)
            runners[i].rollback(keep)
            eager[i].rollback(keep)
    assert stances == []  # no call went through dynamo
    for mine, ref in zip(runners, eager, strict=True):
        length = mine.length
        close(device, mine.cache.keys[0][:, :, :length], ref.cache.keys[0][:, :, :length])
    slots, positions, mask = runners[0].chain_inputs(0, 1)
    args = (runners[0].decoder, runners[0].head, runners[0].cache_arg, runners[0].cache,
            torch.tensor([5], device=device), positions, slots, mask)
    assert torch.is_grad_enabled()
    if compiling.CAN_SKIP_GUARDS:
        with runners[0].attention(), pytest.raises(RuntimeError, match="skip_guard_eval_unsafe"):
            runners[0].plain_step(1)(*args)
        assert stances  # through dynamo


def test_direct_call_falls_back_to_dynamo_where_the_graph_is_not_the_steps_one_to_one():
    """torch_internals.direct_call gives None (dynamo keeps calling) for a recompiled step, for a graph input
    it cannot place, and for a graph whose direct call returns other outputs; else a call that hands
    each of the call's own tensors to its place."""
    cache = type("Cache", (), {})()
    cache.keys, cache.values = [torch.zeros(2)], [torch.ones(2)]
    ids, positions, slots, mask = (torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), torch.zeros(1))
    weight = torch.full((2,), 3.0)
    args = (None, None, "past_key_values", cache, ids, positions, slots, mask)

    def graph(k, i, w, v, *constants):  # the inputs in the graph's own order, a weight among them
        return [k + v + w, i * 1.0]

    out = tuple(graph(cache.keys[0], ids, weight, cache.values[0]))
    example = [cache.keys[0], ids, weight, cache.values[0]]
    call = torch_internals.direct_call([(graph, example)], args, out, "step")
    assert call is not None and call.state.check()
    other = type("Cache", (), {})()
    other.keys, other.values = [torch.full((2,), 10.0)], [torch.zeros(2)]
    logits, hidden = call(None, None, "past_key_values", other, torch.tensor([7]), positions, slots, mask)
    assert torch.equal(logits, torch.full((2,), 13.0)) and torch.equal(hidden, torch.tensor([7.0]))
    assert other.slots is slots  # the side effect dynamo would replay
    assert torch_internals.direct_call([(graph, example)] * 2, args, out, "step") is None  # recompiled
    # a constant more
    assert torch_internals.direct_call([(graph, [*example, torch.zeros(1)])], args, out, "step") is not None
    # values missing
    assert torch_internals.direct_call([(graph, [cache.keys[0], ids, weight, weight])], args, out, "step") is None
    assert torch_internals.direct_call([(lambda *a: [torch.zeros(2), torch.zeros(1)], example)], args, out,
                                       "step") is None
