"""The static runner (specdecpp.fast) against the eager ModelRunner over transformers'
DynamicCache, on tiny float32 Llamas: random sequences of feeds (chains and token trees, inside
and above the buckets), rollbacks and compactions give the same logits and hidden states; slots
above the length never matter; a greedy loop equals the model's own greedy ``generate``; the
compiled backend (slow) compiles each bucket once, whole, and never recompiles."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
from torch._dynamo.utils import counters

from specdecpp.fast import compiling
from specdecpp.fast.calls import CallRunners, new_runner
from specdecpp.fast.kv import StaticKV
from specdecpp.fast.runners import StaticRunner
from specdecpp.fast.step import model_steps
from specdecpp.models.runner import ModelRunner
from tests.helpers.tiny import tiny_lm

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
VOCAB = 16
MAX_LEN = 96
# The compiled tests' model and cache: tiny_lm(32, 32, 2) with a cache of 256 tokens (MIN_MAX_LEN, a decoder's
# smallest call), as the decoders' compiled tests (test_exactness.py, test_fast_decoders.py) have them: their
# steps are one graph each, which inductor's FX graph cache compiles once for all of these tests.
COMPILED_VOCAB = 32
COMPILED_SIZE = 256


@pytest.fixture(scope="module")
def cpu_model():
    return tiny_lm(VOCAB, 32, 2, seed=5, scale=0.6)


def on(device: str, model):
    return model if device == "cpu" else copy.deepcopy(model).to(device)


def close(device: str, mine: torch.Tensor, ref: torch.Tensor) -> None:
    # float32 on a CPU: inductor's kernels sum in another order than eager's (1.4e-5 apart seen on an AMD
    # EPYC, some 30 ulps of logits near 4); a wrong position or a stale cache entry moves them by O(1)
    atol, rtol = (5e-5, 1e-4) if device == "cpu" else (1e-4, 1e-3)
    torch.testing.assert_close(mine, ref, atol=atol, rtol=rtol)


def record_compiles(monkeypatch) -> list:
    """Stand in for inductor (``specdecpp.fast.compiling.compiled_step``): a bucket "compiles" to the eager step, is
    timed at 1e9 s (never worth renting out) and its key is appended to the list returned."""
    compiled = []

    def fake_compiled_step(model, step, key, name, steps=None, options=None):
        steps = model_steps(model) if steps is None else steps
        if key not in steps.compiled:
            compiled.append(key)
            steps.compiled[key], steps.compile_seconds[key] = step, 1e9
        return steps.compiled[key]

    monkeypatch.setattr(compiling, "compiled_step", fake_compiled_step)
    return compiled


def random_tree(rng: random.Random, n: int, cached: int, device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A random token tree of ``n`` nodes after ``cached`` tokens (node 0 the root's child level):
    its positions [n], its boolean mask [n, cached + n] (the cache, the node's ancestors and itself),
    and one node's path (indices of its ancestors and itself, in order)."""
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    mask = torch.zeros(n, cached + n, dtype=torch.bool, device=device)
    mask[:, :cached] = True
    depth = []
    for i, p in enumerate(parents):
        mask[i, cached + i] = True
        if p >= 0:
            mask[i, cached:] |= mask[p, cached:]
        depth.append(0 if p < 0 else depth[p] + 1)
    node = rng.randrange(n)
    path = [i for i in range(n) if mask[node, cached + i]]
    return torch.tensor(depth, device=device) + cached, mask, path


def run_both(rng: random.Random, model, runners, device, steps: int) -> None:
    """Drive the runners through the same random feeds, rollbacks and compactions, asserting that
    logits and hidden states agree with the first (the reference) at every feed."""
    ref, *others = runners
    for _ in range(steps):
        op, length = rng.random(), ref.length
        room = MAX_LEN - length
        if op < 0.45 and room:
            n = rng.choice([1, 1, 2, 3, 4, 5, 7, 9, 16, 31, 33, 40])
            n = min(n, room)
            ids = torch.randint(0, VOCAB, (n,), device=device)
            n_logits = rng.randint(1, n)
            args = (ids, n_logits)
        elif op < 0.65 and room >= 2:
            n = min(rng.randint(2, 12), room)
            ids = torch.randint(0, VOCAB, (n,), device=device)
            positions, mask, path = random_tree(rng, n, length, device)
            args = (ids, n, positions, mask)
        elif op < 0.85:
            keep = rng.randint(0, length)
            for r in runners:
                r.rollback(keep)
            continue
        else:
            prefix = rng.randint(0, length)
            keep = sorted(rng.sample(range(prefix, length), rng.randint(0, length - prefix)))
            for r in runners:
                r.compact(list(range(prefix)) + keep)
            continue
        logits, hidden = ref.feed(*args)
        for r in others:
            mine, mine_hidden = r.feed(*args)
            close(device, mine, logits)
            close(device, mine_hidden, hidden)
            assert r.length == ref.length
        if len(args) == 4:  # a tree: keep the prefix and one node's path, as a tree decoder does
            for r in runners:
                r.compact(list(range(length)) + [length + i for i in path])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_feeds_rollbacks_compactions_match_the_dynamic_cache(cpu_model, seed, device):
    model = on(device, cpu_model)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    runners = [ModelRunner(model, VOCAB, want_hidden=True),
               StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN),
               StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, buckets=(1, 2))]
    with runners[0], runners[1], runners[2]:
        run_both(rng, model, runners, device, steps=40)
        for r in runners[1:]:
            assert r.cache.get_seq_length() == runners[0].length
            for mine, ref in zip(r.cache.layers, runners[0].cache.layers, strict=True):
                assert mine.keys.shape == ref.keys.shape
                close(device, mine.keys, ref.keys)
                close(device, mine.values, ref.values)


@pytest.mark.parametrize("device", DEVICES)
def test_a_width_not_compiled_runs_in_a_compiled_wider_bucket_until_it_pays(device, monkeypatch):
    """fast='compile' without a warm-up (inductor stood in for): a forward whose bucket has not
    compiled runs in the smallest compiled bucket that holds it, chains and token trees alike, with
    the dynamic cache's logits, and compiles once the forwards it served there have taken that
    bucket's compile time; a width no compiled bucket holds compiles at once; warm_up compiles
    every bucket it names."""
    model = on(device, tiny_lm(VOCAB, 32, 2, seed=12, scale=0.6))  # fresh: nothing compiled for it yet
    compiled = record_compiles(monkeypatch)
    runners = CallRunners("compile", (model,))
    fast = runners(MAX_LEN - 8, (1, 2, 4))(model, VOCAB, True)
    ref, size, steps = ModelRunner(model, VOCAB, want_hidden=True), fast.cache.size, model_steps(model)
    with ref:
        for n in (3, 1, 2, 1):  # 3 compiles bucket 4, which then runs 1 and 2
            ids = torch.randint(0, VOCAB, (n,), device=device)
            close(device, fast.feed(ids)[0], ref.feed(ids)[0])
        assert compiled == [(4, size)] and steps.rent[(1, size)] > 0 and steps.rent[(2, size)] > 0
        run_both(random.Random(5), model, [ref, fast], device, steps=30)  # chains and trees, all in bucket 4
        assert compiled == [(4, size)]
        steps.compile_seconds[(4, size)] = steps.rent[(1, size)]  # paid for: bucket 1 compiles on its next forward
        ids = torch.randint(0, VOCAB, (1,), device=device)
        close(device, fast.feed(ids)[0], ref.feed(ids)[0])
        assert compiled == [(4, size), (1, size)]
    runners.warm_up(MAX_LEN - 8, [(model, (1, 2, 4))])
    assert compiled == [(4, size), (1, size), (2, size)]


def test_runners_without_cover_compile_each_bucket_on_its_first_use(monkeypatch):
    """CallRunners(cover=False), what the cost measurements use: a forward runs in its own bucket."""
    model = tiny_lm(VOCAB, 32, 2, seed=13, scale=0.6)
    compiled = record_compiles(monkeypatch)
    runners = CallRunners("compile", (model,), cover=False)
    runner = runners(MAX_LEN - 8, (1, 2, 4))(model, VOCAB, False)
    for n in (3, 1):
        runner.feed(torch.randint(0, VOCAB, (n,)))
    assert compiled == [(4, runner.cache.size), (1, runner.cache.size)]
    assert not runners.batch(MAX_LEN - 8, (1, 2), rows=2)(model, VOCAB, False).cover
    assert CallRunners("compile", (model,)).batch(MAX_LEN - 8, (1, 2), rows=2)(model, VOCAB, False).cover


def as_transformers_5_17_calls(monkeypatch, cache_type) -> list:
    """Make the model call ``cache_type.update(key_states, value_states, layer_idx)`` with no
    ``cache_position`` (as transformers 5.17's Llama attention does); returns the calls' layers."""
    calls, update = [], cache_type.update

    def bare_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        calls.append(layer_idx)
        return update(self, key_states, value_states, layer_idx)

    monkeypatch.setattr(cache_type, "update", bare_update)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_slots_come_from_the_step_not_the_models_cache_position(cpu_model, device, monkeypatch):
    # transformers 5.17 hands update() no cache_position: the step hands the cache its slots itself
    calls = as_transformers_5_17_calls(monkeypatch, StaticKV)
    model = on(device, cpu_model)
    rng = random.Random(7)
    torch.manual_seed(7)
    runners = [ModelRunner(model, VOCAB, want_hidden=True),
               StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN)]
    with runners[0], runners[1]:
        run_both(rng, model, runners, device, steps=30)
    assert calls  # the bare update() was the one the model called


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
def test_slots_above_the_length_change_nothing(cpu_model, device, dtype):
    """Stale slots (rolled back, padding rows, never written) hold huge values: no logit moves,
    in bf16 too (its additive mask, finfo(bf16).min, hides them exactly)."""
    model = on(device, cpu_model) if dtype == torch.float32 else copy.deepcopy(cpu_model).to(device, dtype)
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(4)).to(device)
    clean = StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN)
    dirty = StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN)
    for r in (clean, dirty):
        r.feed(ids[:12])
        r.rollback(7)
    for buf in (*dirty.cache.keys, *dirty.cache.values):
        buf[:, :, dirty.length :] = 1e4
    for chunk in (ids[7:10], ids[10:11], ids[11:16]):
        want, want_hidden = clean.feed(chunk, chunk.shape[0])
        got, got_hidden = dirty.feed(chunk, chunk.shape[0])
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(got_hidden, want_hidden, atol=0, rtol=0)
        for buf in (*dirty.cache.keys, *dirty.cache.values):
            buf[:, :, dirty.length :] = -1e4


@pytest.mark.parametrize("device", DEVICES)
def test_a_chains_inputs_are_made_once_per_model_and_give_the_same_logits(device):
    """StaticRunner.chain_inputs: a chain feed's slots, positions and mask come from a store kept on
    the model, made at a (cache size, start, width) once; they hold what the feed would build (two
    tensors, not aliases, and the causal mask's rows), and a runner that reuses them computes what one
    that made them did, under autograd or not."""
    model = on(device, tiny_lm(VOCAB, 32, 2, seed=11, scale=0.6))  # a fresh model: an empty store
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(6)).to(device)
    store = model_steps(model).chain_inputs
    first, second = (StaticRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN) for _ in range(2))
    outs = []
    for runner, grad in ((first, True), (second, False)):
        with torch.set_grad_enabled(grad):
            out = [runner.feed(ids[:9]), runner.feed(ids[9:10]), runner.feed(ids[10:13], 3)]
        outs.append(out)
    for (a, ha), (b, hb) in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
        torch.testing.assert_close(hb, ha, atol=0, rtol=0)
        assert not a.requires_grad and not b.requires_grad
    size, where = first.cache.size, first.device
    assert set(store) == {(size, torch.float32, where, start, width)
                          for start, width in ((0, 16), (9, 1), (10, 4))}  # widths are buckets: 9 -> 16, 3 -> 4
    made = store[(size, torch.float32, where, 10, 4)]
    slots, positions, mask = made
    assert torch.equal(slots.cpu(), torch.arange(10, 14)) and torch.equal(positions, slots)
    assert slots.data_ptr() != positions.data_ptr()  # an alias would be another compiled graph
    second.rollback(10)
    torch.testing.assert_close(mask, second._mask(4, 4, None), atol=0, rtol=0)
    assert second.chain_inputs(10, 4) is made  # the same objects again, nothing made


def test_wider_than_the_largest_bucket_is_exact_and_said_once(caplog):
    model = tiny_lm(VOCAB, 32, 2, seed=9, scale=0.6)  # a fresh model: the warning is once per model
    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING, logger="specdecpp.fast"):
        for _ in range(2):
            ref = ModelRunner(model, VOCAB, want_hidden=False)
            static = StaticRunner(model, VOCAB, want_hidden=False, max_len=32, buckets=(1, 2, 4))
            for chunk in (ids[:7], ids[7:], ids[:6]):  # 7 > 4 wide, 4 in a bucket, 6 wide again
                logits, hidden = static.feed(chunk, chunk.shape[0])
                assert hidden is None
                close("cpu", logits, ref.feed(chunk, chunk.shape[0])[0])
    wide = [r for r in caplog.records if "wider than the largest bucket (4)" in r.getMessage()]
    assert len(wide) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("buckets", [(1, 2, 4, 8, 16, 32), (1, 2)], ids=["target", "draft"])
def test_greedy_loop_equals_generate(cpu_model, buckets, device):
    """A greedy loop on the static runner (one token a step, then verification-style chunks of the
    reference continuation) reproduces the model's own greedy ``generate``."""
    model = on(device, cpu_model)
    for prompt in ([1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]):
        ref = model.generate(torch.tensor([prompt], device=device), max_new_tokens=24, do_sample=False)[0]
        runner = new_runner(model, VOCAB, want_hidden=False, fast="static", max_len=64, buckets=buckets)
        seq = torch.tensor(prompt, device=device)
        with runner:
            while seq.shape[0] < ref.shape[0]:
                nxt = runner.feed(seq[runner.length :])[0][-1].argmax()
                seq = torch.cat([seq, nxt[None]])
            assert seq.tolist() == ref.tolist()
            for cached, k in ((len(prompt) + 5, 0), (len(prompt) + 2, 6), (len(prompt), 3), (len(prompt) - 1, 20)):
                runner.rollback(cached)  # verification: k + 1 logits over the next token and k more
                assert runner.length == cached
                logits = runner.feed(ref[cached : cached + k + 1], n_logits=k + 1)[0]
                assert logits.argmax(-1).tolist() == ref[cached + 1 : cached + k + 2].tolist()


def test_switch_and_errors(cpu_model):
    assert type(new_runner(cpu_model, VOCAB, want_hidden=False)) is ModelRunner
    runner = new_runner(cpu_model, VOCAB, want_hidden=True, fast="static", max_len=8)
    with pytest.raises(ValueError, match="fast='graphs' needs CUDA"):
        new_runner(cpu_model, VOCAB, want_hidden=False, fast="graphs")
    with pytest.raises(ValueError, match="fast must be one of"):
        new_runner(cpu_model, VOCAB, want_hidden=False, fast="turbo")
    with pytest.raises(ValueError, match="buckets must be strictly increasing"):
        StaticRunner(cpu_model, VOCAB, want_hidden=False, buckets=(4, 2))
    with pytest.raises(ValueError, match="max_len=8 tokens: 0 cached \\+ 9 fed"):
        runner.feed(torch.zeros(9, dtype=torch.long))
    runner.feed(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="n_logits must lie in"):
        runner.feed(torch.zeros(2, dtype=torch.long), n_logits=3)
    with pytest.raises(ValueError, match="attention_mask must be"):
        runner.feed(torch.zeros(2, dtype=torch.long), 2, torch.arange(2), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep must be strictly increasing"):
        runner.compact([0, 2, 2])
    with pytest.raises(ValueError, match="rollback length"):
        runner.rollback(-1)
    assert runner.length == 5
    runner.rollback(9)
    assert runner.length == 5 and runner.cache.get_seq_length() == 5


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_steps_compile_each_bucket_once_whole(device):
    """fast='compile': each bucket compiles once (fullgraph: no graph break), then random feeds,
    rollbacks and compactions on this and a new runner of the same model never recompile, and
    agree with the eager static runner and the dynamic cache."""
    model = on(device, tiny_lm(COMPILED_VOCAB, 32, 2, seed=7, scale=0.6))  # fresh: its steps compile here
    buckets = (1, 2, 4)
    max_len = COMPILED_SIZE - buckets[-1]  # the feeds stay within MAX_LEN (run_both)
    graphs = counters["stats"]["unique_graphs"]
    compiled = StaticRunner(model, COMPILED_VOCAB, want_hidden=True, max_len=max_len, buckets=buckets,
                            fast="compile")
    for n in buckets:
        compiled.feed(torch.zeros(n, dtype=torch.long, device=device))
    assert counters["stats"]["unique_graphs"] - graphs == len(buckets)
    assert set(model_steps(model).compile_seconds) == {(n, compiled.cache.size) for n in buckets}
    breaks = sum(counters["graph_break"].values())
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (0, 1):
            runners = [ModelRunner(model, COMPILED_VOCAB, want_hidden=True),
                       StaticRunner(model, COMPILED_VOCAB, want_hidden=True, max_len=max_len, buckets=buckets),
                       compiled if seed == 0 else
                       StaticRunner(model, COMPILED_VOCAB, want_hidden=True, max_len=max_len, buckets=buckets,
                                    fast="compile")]
            runners[2].rollback(0)
            with runners[0]:
                run_both(random.Random(seed), model, runners, device, steps=30)
    assert counters["stats"]["unique_graphs"] - graphs == len(buckets)
    assert sum(counters["graph_break"].values()) == breaks
