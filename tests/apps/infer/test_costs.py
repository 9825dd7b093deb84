"""python -m infer.costs (was scripts/measure_pair.py) and the one forward timer, specdecpp.core.timing."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch

from infer import costs as cli
from infer import measure
from specdecpp.analysis.costmodel import SCHEMA, load_costs
from specdecpp.core.timing import time_forward, time_forwards
from tests.helpers.tiny import tiny_lm


@pytest.fixture(scope="module")
def costly_pair(tiny_pair, tmp_path_factory):
    """tiny_pair's draft (1 layer of width 32) with a target of 6 layers of width 64 in the target's
    tokenizer: its forward costs several times the draft's, so t_draft < t_target holds on a loaded
    machine too (two test workers on two cores moved medians of the 2-layer target below the draft's)."""
    target = tmp_path_factory.mktemp("costly") / "target"
    model = tiny_lm(tiny_pair.vocab, 64, 6, seed=13, scale=0.15)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        setattr(model.config, key, getattr(tiny_pair.tokenizer, key))
    model.save_pretrained(target)
    tiny_pair.tokenizer.save_pretrained(target)
    return type(tiny_pair)(draft=tiny_pair.draft, target=str(target))


def test_time_forward_times_each_call_from_the_reset_state():
    state = {"fed": 0}

    def feed():  # like a forward that grows a cache: slow unless the cache was rolled back
        time.sleep(0.004 if state["fed"] == 0 else 0.03)
        state["fed"] += 1

    def rollback():
        time.sleep(0.03)  # never counted
        state["fed"] = 0

    t = time_forward(feed, reset=rollback, repeats=4, warmup=1)
    assert len(t.times) == 4 and all(0.003 < x < 0.02 for x in t.times)
    assert state["fed"] == 0  # left reset


def test_time_forwards_interleaves_calls_and_stops_on_request():
    order = []
    timed = time_forwards({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3, warmup=1)
    # each measurement: Timer's two untimed warm-up calls, then the timed one; a's, then b's, 4 times
    assert order == (["a"] * 3 + ["b"] * 3) * 4 and all(len(t.times) == 3 for t in timed.values())
    rounds = []
    timed = time_forwards({"x": lambda: None}, resets={"x": lambda: rounds.append(1)},
                          until=lambda: len(rounds) >= 14, warmup=2)
    assert len(timed["x"].times) == 5  # 2 resets per measurement: 7 measurements, 2 of them warm-up
    with pytest.raises(ValueError, match="unknown calls"):
        time_forwards({"a": lambda: None}, resets={"b": lambda: None})


@pytest.mark.gpu
def test_time_forward_waits_for_cuda_kernels():
    x = torch.randn(4096, 4096, device="cuda")
    t = time_forward(lambda: x @ x, repeats=5)
    assert t.median > 1e-4  # a 4096^3 matmul is not a launch (~10 us)


def test_position_acceptance_is_one_for_identical_models_and_less_otherwise(tiny_models):
    draft, target = tiny_models
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    same, covered = measure.position_acceptance(target, target, ids, 2)
    assert torch.allclose(same, torch.ones(4)) and torch.allclose(covered, torch.ones(4))
    alpha, _ = measure.position_acceptance(draft, target, ids, 2)
    assert alpha.shape == (4,) and (alpha < 1).all() and (alpha > 0).all()
    # a draft that scores only tokens 0-3: the target mass it covers is p(0..3) at each position
    from specdecpp.models.reduced_vocab import restrict_output_vocab

    small = copy.deepcopy(draft)
    restrict_output_vocab(small, [0, 1, 2, 3])
    alpha_small, covered = measure.position_acceptance(small, target, ids, 2)
    with torch.no_grad():
        p = measure.warp(target(ids[:, :-1]).logits[0, 1:], measure.SAMPLING)
    torch.testing.assert_close(covered, p[:, :4].sum(-1))
    assert (alpha_small <= covered + 1e-6).all()


def test_cli_writes_costs_json_in_the_one_schema(costly_pair, tmp_path, capsys):
    costs_path, out = tmp_path / "c" / "costs.json", tmp_path / "pair.json"
    cli.main(["--draft", costly_pair.draft, "--target", costly_pair.target, "--sources", "bundled", "--limit", "1",
                  "--max-new-tokens", "6", "--timing-steps", "9", "--dtype", "float32", "--costs-out", str(costs_path),
                  "--out", str(out)])
    assert "cost ratio" in capsys.readouterr().out
    raw = json.loads(costs_path.read_text())
    assert raw["schema"] == SCHEMA and raw["measured_by"] == "python -m infer.costs"
    costs = load_costs(costs_path)  # the loader infer.potential and infer.report use
    # 1 layer of width 32 against 6 of width 64 (medians of 9: a load spike moved medians of 3)
    assert 0 < costs.t_draft < costs.t_target
    assert sorted(costs.target_by_width) == list(range(1, 9)) and costs.target_cost(1) == costs.t_target
    assert (costs.meta["dtype"] == "float32" and costs.meta["device"] == "cpu"
            and costs.meta["draft"] == costly_pair.draft)
    result = json.loads(out.read_text())
    assert 0 < result["acceptance"] < 1 and result["per_source"]["bundled"]["prompts"] == 1


def test_cli_passes_its_settings_as_one_measure_config(tiny_pair, tmp_path, monkeypatch):
    """The command line's settings reach ``measure`` as one MeasureConfig, built in costs.main."""
    seen = {}

    def fake_measure(draft, target, config):
        seen.update(draft=draft, target=target, config=config)
        raise SystemExit("measured")

    monkeypatch.setattr(cli, "measure", fake_measure)
    with pytest.raises(SystemExit, match="measured"):
        cli.main(["--draft", tiny_pair.draft, "--target", tiny_pair.target, "--device", "cpu", "--sources", "bundled",
                  "--limit", "3", "--max-new-tokens", "5", "--timing-steps", "7", "--seed", "2", "--dtype", "float32",
                  "--compare-dtype", "bfloat16", "--max-width", "12", "--batch-sizes", "2", "4", "--fast", "static",
                  "--costs-out", str(tmp_path / "costs.json")])
    assert (seen["draft"], seen["target"]) == (tiny_pair.draft, tiny_pair.target)
    assert seen["config"] == measure.MeasureConfig(
        sources=("bundled",), limit=3, max_new_tokens=5, timing_steps=7, seed=2, dtype="float32",
        compare_dtypes=("bfloat16",), device="cpu", max_width=12, batch_sizes=(2, 4), fast="static")


def test_cli_batch_sizes_write_the_batched_curves(costly_pair, tmp_path, capsys):
    """--batch-sizes: t_draft(B) and t_target(B, n) for B = 1 and each size, n = 1..8, in costs.json,
    read back by the cost model (the batched Eq. 2.3 of infer.report and scripts/bench_batch.py)."""
    costs_path = tmp_path / "costs.json"
    cli.main(["--draft", costly_pair.draft, "--target", costly_pair.target, "--sources", "bundled", "--limit", "1",
                  "--max-new-tokens", "4", "--timing-steps", "2", "--dtype", "float32", "--batch-sizes", "3",
                  "--costs-out", str(costs_path)])
    assert "batch 3: draft step" in capsys.readouterr().out
    costs = load_costs(costs_path)
    assert sorted(costs.target_by_batch) == [1, 3] and sorted(costs.draft_by_batch) == [1, 3]
    assert sorted(costs.target_by_batch[3]) == list(range(1, 9))
    assert all(t > 0 for curve in costs.target_by_batch.values() for t in curve.values())
    assert costs.batch_target_cost(3, 2) == costs.target_by_batch[3][2]
    with pytest.raises(SystemExit):
        cli.main(["--draft", costly_pair.draft, "--target", costly_pair.target, "--batch-sizes", "0",
                      "--costs-out", str(costs_path)])
    assert "--batch-sizes must be >= 1" in capsys.readouterr().err


def test_cli_bad_input_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--draft", "a", "--target", "b"])
    assert "nothing to write" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--pair", "nope", "--costs-out", str(tmp_path / "c.json")])
    assert "no conf/pair/nope.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--pair", "custom", "--costs-out", str(tmp_path / "c.json")])
    assert "sets no draft model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--draft", str(tmp_path / "missing"), "--target", str(tmp_path), "--costs-out", "c.json"])
    assert "missing' does not exist" in capsys.readouterr().err


def test_a_feature_draft_is_measured_at_each_depth_and_timed_on_its_own_output(costly_pair, tmp_path, capsys):
    """A feature draft (EAGLE-3) through infer.costs: its acceptance at depth d is the overlap of p with
    the q of drafting as a round's d-th candidate (labels' feature_draft_logits), depth 1 in the
    overall figure, the other depths in acceptance_by_depth; its step is a drafting step on its own
    previous output, cheaper than the 6-layer target's; options it does not take are refused."""
    from specdecpp.data.labels import feature_draft_logits
    from specdecpp.models.feature_draft import FeatureDraft
    from specdecpp.models.loading import load_model

    target = load_model(costly_pair.target, "cpu")
    draft = FeatureDraft.init_from(target, draft_vocab=torch.arange(0, target.config.vocab_size, 2),
                                   generator=torch.Generator().manual_seed(0))
    draft.save_pretrained(tmp_path / "feature")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    alpha, covered = measure.position_acceptance(draft, target, ids, 3, depths=2)
    with torch.no_grad():
        p = measure.warp(target(ids[:, :-1]).logits[0, 2:], measure.SAMPLING)
    at = feature_draft_logits(draft, target, [[1, 2, 3]], [[4, 5, 6, 7]], p.shape[-1], 2)
    for d in (1, 2):
        want = torch.minimum(p, measure.warp(at(0, d, 0, 4), measure.SAMPLING)).sum(-1)
        torch.testing.assert_close(alpha[:, d - 1], want)
    torch.testing.assert_close(covered, p[:, ::2].sum(-1))
    costs_path, out = tmp_path / "costs.json", tmp_path / "pair.json"
    cli.main(["--draft", str(tmp_path / "feature"), "--target", costly_pair.target, "--sources", "bundled",
              "--limit", "1", "--max-new-tokens", "6", "--timing-steps", "9", "--dtype", "float32",
              "--costs-out", str(costs_path), "--out", str(out)])
    assert "acceptance at depths 1..4" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert len(result["acceptance_by_depth"]["bundled"]) == 4
    assert result["acceptance"] == pytest.approx(result["acceptance_by_depth"]["bundled"][0])
    assert 0 < result["draft_step_s"] < result["target_step_s"] and set(result["draft_by_width_s"]) == {"1"}
    with pytest.raises(ValueError, match="feature draft is measured batch 1"):
        cli.main(["--draft", str(tmp_path / "feature"), "--target", costly_pair.target, "--limit", "1",
                  "--batch-sizes", "2", "--costs-out", str(tmp_path / "c2.json")])
    # --fast times the target on the static runner and the draft on its own eager runner (its fast path)
    cli.main(["--draft", str(tmp_path / "feature"), "--target", costly_pair.target, "--sources", "bundled",
              "--limit", "1", "--max-new-tokens", "6", "--timing-steps", "9", "--dtype", "float32", "--fast", "static",
              "--costs-out", str(tmp_path / "c3.json"), "--out", str(tmp_path / "pair3.json")])
    fast = json.loads((tmp_path / "pair3.json").read_text())
    assert 0 < fast["draft_step_s"] < fast["target_step_s"] and fast["acceptance"] == result["acceptance"]
