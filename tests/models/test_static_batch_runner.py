"""The static batch runner (specdecpp.fast.batch_runner.StaticBatchRunner) against the eager BatchRunner
over transformers' DynamicCache, on tiny float32 Llamas: random sequences of ragged feeds,
rollbacks, compactions, rows leaving (select) and joining (add_rows) give the same logits and hidden
states in every row's real columns, and the same per-row caches; slots above each row's length and
buffer rows no row holds never matter; the compiled backend (slow) compiles each (batch, width)
bucket once, whole, and never recompiles."""

# ruff: noqa: F811 (test arguments named as the fixture imported from test_static_runner)
from __future__ import annotations

import logging
import random

import pytest
import torch
from torch._dynamo.utils import counters

from specdecpp.decoders.batch import BatchRunner
from specdecpp.fast.batch_runner import StaticBatchRunner
from specdecpp.fast.calls import CallRunners
from specdecpp.fast.kv import RowWindow
from specdecpp.fast.step import model_steps
from tests.helpers.tiny import tiny_lm
from tests.models.test_static_runner import (  # the one-row runner's model and helpers, reused as they are
    COMPILED_SIZE,
    COMPILED_VOCAB,
    DEVICES,
    MAX_LEN,
    VOCAB,
    as_transformers_5_17_calls,
    close,
    cpu_model,  # noqa: F401
    on,
    record_compiles,
)


def tokens(n: int, device) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), device=device)


def compare_feed(device, runners, chunks, n_logits) -> None:
    """Feed ``chunks`` to every runner; the real columns' logits and hidden states agree with the
    first runner's (the others are filler in every runner)."""
    ref, *others = runners
    want, want_hidden = ref.feed(chunks, n_logits)
    width = max(c.shape[0] for c in chunks)
    for r in others:
        got, got_hidden = r.feed(chunks, n_logits)
        assert got.shape == want.shape and got_hidden.shape == want_hidden.shape
        for b, c in enumerate(chunks):
            real = slice(0, max(0, c.shape[0] - (width - got.shape[1])))  # the last columns are kept
            close(device, got[b, real], want[b, real])
            close(device, got_hidden[b, real], want_hidden[b, real])
        assert r.lengths == ref.lengths


def run_random(rng: random.Random, runners, device, steps: int, max_rows: int) -> None:
    """The same random ragged feeds, rollbacks, compactions, selects and joins on every runner."""
    ref = runners[0]
    for _ in range(steps):
        op = rng.random()
        if (op < 0.12 or not ref.rows) and ref.rows < max_rows:  # rows join, some with an empty prefix
            new = rng.randint(1, max_rows - ref.rows)
            prefixes = [tokens(rng.choice([0, 1, 3, 6, 11]), device) for _ in range(new)]
            for r in runners:
                r.add_rows(prefixes)
        elif op < 0.55:
            room = [MAX_LEN - n for n in ref.lengths]
            chunks = [tokens(min(room[b], rng.choice([0, 1, 1, 2, 3, 4, 5, 9])), device) for b in range(ref.rows)]
            if max(c.shape[0] for c in chunks) == 0:
                continue
            width = max(c.shape[0] for c in chunks)
            compare_feed(device, runners, chunks, rng.choice([None, 1, rng.randint(1, width)]))
        elif op < 0.8:
            keep = [rng.randint(0, n) for n in ref.lengths]
            for r in runners:
                r.rollback(keep)
        elif op < 0.88:
            for r in runners:
                r.compact()
        else:  # rows leave, the others in a new order
            keep = rng.sample(range(ref.rows), rng.randint(0, ref.rows))
            if keep and not any(ref.lengths[b] for b in keep):
                continue  # the eager runner's select keeps the cache's columns when no row holds a token
            for r in runners:
                r.select(keep)


def assert_same_row_caches(device, runners) -> None:
    ref, *others = runners
    for r in others:
        for b in range(ref.rows):
            mine, want = r.row_cache(b), ref.row_cache(b)
            for m, w in zip(mine.layers, want.layers, strict=True):
                assert m.keys.shape == w.keys.shape
                close(device, m.keys, w.keys)
                close(device, m.values, w.values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_match_the_eager_batch_runner(cpu_model, seed, device):
    model = on(device, cpu_model)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    runners = [BatchRunner(model, VOCAB, want_hidden=True),
               StaticBatchRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, rows=3),
               # small buckets: wider forwards and more rows than the largest bucket run unpadded
               StaticBatchRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, buckets=(1, 2), batch_buckets=(1, 2))]
    with runners[0], runners[1], runners[2]:
        run_random(rng, runners, device, steps=60, max_rows=6)
        assert_same_row_caches(device, runners)
    assert runners[1].n_moved_rows > 0  # rows left from low buffer rows and the batch bucket shrank
    assert runners[1].capacity == 8  # grown from 4 (3 rows) when more joined


@pytest.mark.parametrize("device", DEVICES)
def test_slots_come_from_the_step_not_the_models_cache_position(cpu_model, device, monkeypatch):
    # as transformers 5.17 calls it: update(key_states, value_states, layer_idx), no cache_position
    calls = as_transformers_5_17_calls(monkeypatch, RowWindow)
    model = on(device, cpu_model)
    rng = random.Random(3)
    torch.manual_seed(3)
    runners = [BatchRunner(model, VOCAB, want_hidden=True),
               StaticBatchRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, rows=3)]
    with runners[0], runners[1]:
        run_random(rng, runners, device, steps=30, max_rows=4)
        assert_same_row_caches(device, runners)
    assert calls


def test_rows_leaving_free_their_slot_and_the_bucket_shrinks(cpu_model):
    runner = StaticBatchRunner(cpu_model, VOCAB, want_hidden=False, max_len=MAX_LEN, rows=4)
    runner.add_rows([tokens(n, "cpu") for n in (2, 3, 4, 5)])
    assert runner.slot_of == [0, 1, 2, 3] and runner.capacity == 4
    runner.select([3, 1])  # rows in buffer rows 3 and 1 stay: bucket 4 > 2, so buffer row 3 moves to 0
    assert runner.slot_of == [0, 1] and runner.lengths == [5, 3] and runner.n_moved_rows == 1
    runner.add_rows([tokens(1, "cpu")])  # the lowest free buffer row, no copy
    assert runner.slot_of == [0, 1, 2] and runner.n_moved_rows == 1
    runner.select([2, 0])  # buffer rows 2 and 0: bucket 4 > 2, buffer row 2 moves to 1
    assert runner.slot_of == [1, 0] and runner.n_moved_rows == 2
    runner.select([1])  # buffer row 0: no move
    assert runner.slot_of == [0] and runner.lengths == [5] and runner.n_moved_rows == 2
    assert runner.compact() is None and runner.n_compactions == 0 and runner.width == runner.size


@pytest.mark.parametrize("device", DEVICES)
def test_slots_above_the_lengths_and_free_rows_change_nothing(cpu_model, device):
    """Stale slots (rolled back, padding columns, never written) and buffer rows no row holds
    (padding rows of a batch bucket) hold huge values: no logit moves, bit for bit."""
    model = on(device, cpu_model)
    g = torch.Generator().manual_seed(4)
    prefixes = [torch.randint(0, VOCAB, (n,), generator=g).to(device) for n in (9, 4, 12)]
    clean, dirty = (StaticBatchRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, rows=4) for _ in range(2))
    for r in (clean, dirty):
        r.add_rows(prefixes)
        r.rollback([7, 4, 5])
    for step, widths in enumerate(((1, 3, 2), (2, 0, 1), (4, 1, 1))):
        for buf in (*dirty.keys, *dirty.values):
            buf[3] = 1e4 * (-1) ** step  # the bucket's padding row
            for slot, n in zip(dirty.slot_of, dirty.lengths, strict=True):
                buf[slot, :, n:] = -1e4 * (-1) ** step
        chunks = [torch.randint(0, VOCAB, (n,), generator=g).to(device) for n in widths]
        want, want_hidden = clean.feed(chunks)
        got, got_hidden = dirty.feed(chunks)
        for b, n in enumerate(widths):
            torch.testing.assert_close(got[b, :n], want[b, :n], atol=0, rtol=0)
            torch.testing.assert_close(got_hidden[b, :n], want_hidden[b, :n], atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_reads_only_the_slots_below_its_width(cpu_model, device):
    """Rows joining are prefilled over their longest prefix's slots only, not the whole buffer: the
    slots above it may even hold NaN (which a masked read would spread), the prefill writes finite
    keys and values, and the next feed's logits equal the eager runner's."""
    model = on(device, cpu_model)
    g = torch.Generator().manual_seed(8)
    prefixes = [torch.randint(0, VOCAB, (n,), generator=g).to(device) for n in (9, 4, 12)]
    static = StaticBatchRunner(model, VOCAB, want_hidden=True, max_len=MAX_LEN, rows=4)
    for buf in (*static.keys, *static.values):
        buf[:, :, 12:] = float("nan")
    eager = BatchRunner(model, VOCAB, want_hidden=True)
    with eager:
        for r in (eager, static):
            r.add_rows(prefixes)
        for buf in (*static.keys, *static.values):
            assert buf[:3, :, :12].isfinite().all()
            buf[:, :, 12:] = 0.0  # decoding forwards read every slot, masked
        compare_feed(device, [eager, static], [torch.randint(0, VOCAB, (1,), generator=g).to(device)] * 3, None)


def test_errors_and_the_wide_forward_warning(cpu_model, caplog):
    model = tiny_lm(VOCAB, 32, 2, seed=9, scale=0.6)  # a fresh model: the warnings are once per model
    runner = StaticBatchRunner(model, VOCAB, want_hidden=False, max_len=12, buckets=(1, 2), batch_buckets=(1, 2))
    with pytest.raises(ValueError, match="max_len=12 tokens per row: a prefix of 13"):
        runner.add_rows([tokens(13, "cpu")])
    runner.add_rows([tokens(10, "cpu"), tokens(0, "cpu"), tokens(2, "cpu")])
    with pytest.raises(ValueError, match="2 chunks for 3 rows"):
        runner.feed([tokens(1, "cpu")] * 2)
    with pytest.raises(ValueError, match="every chunk is empty"):
        runner.feed([tokens(0, "cpu")] * 3)
    with pytest.raises(ValueError, match="row 0 has 10 cached \\+ 3 fed"):
        runner.feed([tokens(3, "cpu")] * 3)
    with pytest.raises(ValueError, match="rollback lengths must be >= 0"):
        runner.rollback([1, -1, 0])
    with pytest.raises(ValueError, match="select: keep must name distinct rows in \\[0, 3\\)"):
        runner.select([0, 0])
    with caplog.at_level(logging.WARNING, logger="specdecpp.fast"):
        runner.feed([tokens(1, "cpu"), tokens(3, "cpu"), tokens(0, "cpu")])  # 3 rows > 2, 3 tokens > 2
        runner.feed([tokens(1, "cpu"), tokens(3, "cpu"), tokens(1, "cpu")])
    said = [r.getMessage() for r in caplog.records]
    assert sum("3 rows is wider than the largest bucket (2)" in m for m in said) == 1
    assert sum("3 tokens is wider than the largest bucket (2)" in m for m in said) == 1
    with pytest.raises(ValueError, match="fast=None needs the eager batch runner"):
        CallRunners(None, (model,)).batch(20)
    assert CallRunners(None, (model,)).batch(20, eager=BatchRunner) is BatchRunner


@pytest.mark.parametrize("device", DEVICES)
def test_a_bucket_not_compiled_runs_in_a_compiled_larger_one_until_it_pays(device, monkeypatch):
    """fast='compile' without a warm-up (inductor stood in for): when a batch drains, its
    smaller bucket runs in the compiled larger one (padding rows) and does not compile, with the
    eager runner's logits, until those forwards have taken the larger bucket's compile time; a
    width no compiled bucket holds compiles at once; warm_up compiles every bucket it names."""
    model = on(device, tiny_lm(VOCAB, 32, 2, seed=11, scale=0.6))  # fresh: nothing compiled for it yet
    compiled = record_compiles(monkeypatch)
    runners = CallRunners("compile", (model,))
    fast = runners.batch(MAX_LEN - 8, (1, 2), rows=4)(model, VOCAB, True)
    ref, size, steps = BatchRunner(model, VOCAB, want_hidden=True), fast.size, model_steps(model)
    g = torch.Generator().manual_seed(5)

    def rand(n: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (n,), generator=g).to(device)

    with ref:
        prefixes = [rand(n) for n in (5, 3, 7, 2)]
        for r in (ref, fast):
            r.add_rows(prefixes)
        compare_feed(device, [ref, fast], [rand(1) for _ in range(4)], None)
        assert compiled == [(1, size, 4)]
        for r in (ref, fast):
            r.select([2, 0])  # two rows left: bucket 2, run in bucket 4
        for _ in range(3):
            compare_feed(device, [ref, fast], [rand(1), rand(1)], None)
        for r in (ref, fast):
            r.select([1])  # one row: bucket 1, run in bucket 4
        compare_feed(device, [ref, fast], [rand(1)], None)
        assert compiled == [(1, size, 4)] and steps.rent[(1, size, 2)] > 0 and steps.rent[(1, size, 1)] > 0
        compare_feed(device, [ref, fast], [rand(2)], None)  # width 2: no compiled bucket holds it
        assert compiled == [(1, size, 4), (2, size, 1)]
        compare_feed(device, [ref, fast], [rand(1)], None)  # run in (2, 1), the smallest that holds it
        assert compiled == [(1, size, 4), (2, size, 1)]
        steps.compile_seconds[(2, size, 1)] = steps.rent[(1, size, 1)]  # paid for: it compiles now
        compare_feed(device, [ref, fast], [rand(1)], None)
        assert compiled[-1] == (1, size, 1)
    runners.warm_up(MAX_LEN - 8, [(model, (1, 2))], rows=4)
    assert set(compiled) == {(w, size, b) for w in (1, 2) for b in (1, 2, 4)}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_steps_compile_each_batch_bucket_once_whole(device):
    """fast='compile': warm_up compiles every (batch, width) bucket once (fullgraph: no graph
    break); then random ops on runners of other capacities (the steps see views of the first B
    buffer rows, so the capacity is no part of a graph) never recompile, and agree with the eager
    batch runner."""
    model = on(device, tiny_lm(COMPILED_VOCAB, 32, 2, seed=7, scale=0.6))  # fresh: its steps compile here
    buckets, rows = (1, 2, 4), 3
    runners = CallRunners("compile", (model,))
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    assert runners.warm_up(MAX_LEN - 4, [(model, buckets)], rows=rows) > 0
    size = runners.size
    assert size == COMPILED_SIZE  # the decoders' compiled tests' steps (test_static_runner.py's COMPILED_SIZE)
    assert set(model_steps(model).compile_seconds) == {(w, size, b) for w in buckets for b in (1, 2, 4)}
    assert counters["stats"]["unique_graphs"] - graphs == 9
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, capacity in ((0, 3), (1, 4), (2, 1)):
            make = runners.batch(MAX_LEN - 4, buckets, capacity)
            compiled = make(model, COMPILED_VOCAB, True)
            assert compiled.size == size
            batch = [BatchRunner(model, COMPILED_VOCAB, want_hidden=True), compiled]
            with batch[0]:
                run_random(random.Random(seed), batch, device, steps=40, max_rows=4)
    assert counters["stats"]["unique_graphs"] - graphs == 9
    assert sum(counters["graph_break"].values()) == breaks
