"""infer: every method through run(cfg) on tiny models, greedy equality in the result files,
counts, resume, method configs, sweeps, the report on a tiny run, one EOS set for every stage, the
pair from the head, batched rows, both head kinds side by side, bad input. The report on synthetic
rows: tests/apps/infer/test_report.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException

import infer.app as app
from infer import sweep
from infer.report import build_report
from infer.report import main as report_main
from infer.results import ResultWriter, prompt_seed, read_result_dir, read_rows
from infer.summary import summarize_results
from specdecpp import AcceptanceHead, SamplingConfig, SpecDecPP, SpeculativeDecoder
from specdecpp.analysis.costmodel import Costs, save_costs
from specdecpp.models.loading import load_model
from tests.helpers.infer import make_cfg
from tests.helpers.paths import CONF, REPO
from tests.helpers.tiny import ConstantNext

ROW_KEYS = {"method", "settings", "tag", "pair", "prompts", "sampling", "seed", "prompt_id", "n_generated",
            "n_target", "n_draft", "n_discarded", "accept_lengths", "candidate_lengths", "draft_time_s",
            "target_time_s", "wall_time_s", "tokens_per_s", "output_ids", "max_new_tokens"}
MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("infer")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n'
                       '{"id": "math", "prompt": "What is 12 times 7?"}\n')
    head = root / "head"
    AcceptanceHead(tiny_pair.draft_hidden, 1, draft=tiny_pair.draft).save_pretrained(head)
    base = [f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "prompts=jsonl",
            f"prompts.path={prompts}", f"max_new_tokens={MAX_NEW}", "warmup_tokens=2", "progress=false"]
    return type("Setup", (), {"root": root, "prompts": prompts, "head": head, "base": base,
                              "pair": tiny_pair})


GREEDY_METHODS = {
    "target_only": ["method=target_only"],
    "fixed_k": ["method=fixed_k", "method.k=3"],
    "svip": ["method=svip", "method.threshold=0.5"],
    "specdecpp": ["method=specdecpp", "method.threshold=0.5"],  # + method.head
    "hf_constant": ["method=hf_assisted", "method.mode=constant", "method.num_assistant_tokens=3"],
    "hf_heuristic": ["method=hf_assisted", "method.mode=heuristic", "method.num_assistant_tokens=2"],
    "oracle": ["method=oracle"],
}


@pytest.fixture(scope="module")
def greedy_results(setup):
    """Every method, greedy, on the tiny pair: {name: rows}."""
    out = setup.root / "greedy"
    results = {}
    for name, overrides in GREEDY_METHODS.items():
        head = [f"method.head={setup.head}"] if name == "specdecpp" else []
        summary = app.run(make_cfg(*setup.base, *overrides, *head, "sampling=greedy", f"out={out}/{name}"))
        results[name] = read_rows(Path(summary["path"]))
    return out, results


def test_every_method_writes_complete_rows(greedy_results):
    _, results = greedy_results
    for name, rows in results.items():
        assert [r["prompt_id"] for r in rows] == ["sea", "math"], name
        for r in rows:
            assert ROW_KEYS <= set(r), (name, ROW_KEYS - set(r))
            assert r["n_generated"] == len(r["output_ids"]) == MAX_NEW, name  # these models emit no EOS here
            assert r["n_target"] == len(r["accept_lengths"]) == len(r["candidate_lengths"]), name
            assert r["n_draft"] == sum(r["candidate_lengths"]), name
            assert r["n_discarded"] == sum(r["candidate_lengths"]) - sum(r["accept_lengths"]), name
            assert r["n_draft"] + r["n_target"] == r["n_generated"] + r["n_discarded"], name  # Eq. 2.1 identity
            if name == "oracle":
                assert r["wall_time_s"] is None and r["forward_time_s"] is None and r["n_discarded"] == 0
            else:
                assert r["wall_time_s"] > 0 and r["target_time_s"] > 0
                assert 0 < r["forward_time_s"] < r["wall_time_s"], name
    assert all(r["n_draft"] == 0 for r in results["target_only"])
    assert all(max(r["candidate_lengths"]) <= 3 for r in results["fixed_k"])
    assert all(r["candidate_lengths"][0] == 3 for r in results["hf_constant"])
    assert all(r["candidate_lengths"][0] == 2 for r in results["hf_heuristic"])


def test_greedy_outputs_equal_target_only(greedy_results):
    _, results = greedy_results
    reference = {r["prompt_id"]: r["output_ids"] for r in results["target_only"]}
    for name, rows in results.items():
        assert {r["prompt_id"]: r["output_ids"] for r in rows} == reference, name


def test_sequoia_rows_and_tree_choice(setup, greedy_results, tmp_path):
    """method=sequoia through run(cfg): greedy rows equal target-only's and carry the tree's size
    and tokens per target call; with tree=null the DP chooses the tree from an acceptance file and
    a costs.json with both width curves."""
    from specdecpp import TokenTree

    _, results = greedy_results
    reference = {r["prompt_id"]: r["output_ids"] for r in results["target_only"]}
    summary = app.run(make_cfg(*setup.base, "method=sequoia", "method.tree=[-1,-1,0,0,1]", "sampling=greedy",
                               f"out={tmp_path}/list"))
    rows = read_rows(Path(summary["path"]))
    assert {r["prompt_id"]: r["output_ids"] for r in rows} == reference
    for r in rows:
        assert r["tree_size"] == 6 and r["tree_depth"] == 3 and set(r["candidate_lengths"]) <= {0, 2, 5}
        assert r["tokens_per_target_call"] == pytest.approx(r["n_generated"] / r["n_target"])
        assert r["settings"]["parents"] == [-1, -1, 0, 0, 1] and 0 < r["forward_time_s"] < r["wall_time_s"]
    assert Path(summary["path"]).name.startswith("n6_d3_")
    acceptance, costs = tmp_path / "acc.json", tmp_path / "costs.json"
    acceptance.write_text(json.dumps({"schema": "specdecpp.acceptance/1", "acceptance": [0.6, 0.2, 0.1]}))
    widths = [1, 2, 4, 8]
    save_costs(Costs(0.001, 0.01, {n: 0.01 * (1 + 0.01 * n) for n in widths},
                     draft_by_width={n: 0.001 for n in widths}), costs)
    summary = app.run(make_cfg(*setup.base, "method=sequoia", "method.tree=null", f"method.acceptance={acceptance}",
                               f"method.costs={costs}", "method.max_depth=4", "sampling=greedy", "prompts.limit=1",
                               f"out={tmp_path}/dp"))
    (row,) = read_rows(Path(summary["path"]))
    assert row["tree_size"] == 8 and row["output_ids"] == reference["sea"]
    assert row["settings"]["expected_tokens"] == pytest.approx(TokenTree(row["settings"]["parents"]).expected_tokens(
        [0.6, 0.2, 0.1]))
    report = build_report(tmp_path, tmp_path / "report", costs)
    (group,) = report["groups"]
    (dp_entry,) = [e for e in group["entries"] if e["settings"]["tree_source"].startswith("dp")]
    assert dp_entry["tokens_per_target_call"] == pytest.approx(row["tokens_per_target_call"])
    assert dp_entry["predicted_tokens_per_s"] is None  # constant-cost Eq. 2.3 does not price trees
    assert "tokens per target call (the DP's G(n, d) = " in report["text"] and len(report["images"]) == 2
    with pytest.raises(ValueError, match="method.acceptance"):
        app.run(make_cfg(*setup.base, "method=sequoia", "method.tree=null", f"out={tmp_path}/bad"))
    with pytest.raises(ValueError, match="breadth-first"):
        app.run(make_cfg(*setup.base, "method=sequoia", "method.tree=[-1,0,-1]", f"out={tmp_path}/bad"))


def test_self_draft_accepts_everything(setup):
    """With the target as its own draft every candidate is accepted, in our engine and in HF's
    loop (checks the hook and streamer counting), greedy and sampled."""
    target = setup.pair.target
    for sampling in ("greedy", "paper"):
        for overrides in (["method=fixed_k", "method.k=2"],
                          ["method=hf_assisted", "method.mode=constant", "method.num_assistant_tokens=2"]):
            cfg = make_cfg(*setup.base, *overrides, f"pair.draft={target}", f"sampling={sampling}",
                           "prompts.limit=1", f"out={setup.root}/self/{sampling}", "warmup_tokens=0")
            (row,) = read_rows(Path(app.run(cfg)["path"]))
            assert row["accept_lengths"] == row["candidate_lengths"], (sampling, overrides)
            assert row["n_discarded"] == 0
            # rounds of k accepted + 1 token, the last round capped by max_new_tokens
            assert row["candidate_lengths"] == [2, 2] and row["n_target"] == 2 and row["n_generated"] == MAX_NEW


def test_resume_keeps_rows_and_redoes_only_missing(setup):
    out = setup.root / "resume"
    common = [*setup.base, "method=fixed_k", "method.k=2", "sampling=paper", f"out={out}"]
    first = app.run(make_cfg(*common, "prompts.limit=1"))
    path = Path(first["path"])
    kept = path.read_text()
    assert first["rows"] == 1
    full = app.run(make_cfg(*common))
    assert full["rows"] == 2 and full["new_rows"] == 1
    assert path.read_text().startswith(kept)  # the first row is untouched
    rows = read_rows(path)
    # interrupted mid-write: a truncated last line is dropped and that prompt redone identically
    path.write_text(kept + json.dumps(rows[1])[:40])
    again = app.run(make_cfg(*common))
    redone = read_rows(path)
    assert again["new_rows"] == 1 and [r["prompt_id"] for r in redone] == ["sea", "math"]
    assert redone[1]["output_ids"] == rows[1]["output_ids"]  # same seed per prompt id
    assert app.run(make_cfg(*common))["new_rows"] == 0  # complete: skipped
    # the same file with other settings is refused and left untouched
    before = path.read_text()
    bad = make_cfg(*common, "max_new_tokens=5")
    with pytest.raises(ValueError, match="max_new_tokens"):
        app.prepare(bad)
    assert path.read_text() == before


def test_retrained_head_in_same_directory_is_another_run(setup, tmp_path):
    head = tmp_path / "head"
    AcceptanceHead(setup.pair.draft_hidden, 1, draft=setup.pair.draft).save_pretrained(head)
    common = [*setup.base, "method=specdecpp", f"method.head={head}", "max_new_tokens=2", "prompts.limit=1",
              "warmup_tokens=0", f"out={tmp_path}/out"]
    assert app.run(make_cfg(*common))["rows"] == 1
    AcceptanceHead(setup.pair.draft_hidden, 1, draft=setup.pair.draft).save_pretrained(head)  # new weights
    with pytest.raises(ValueError, match="different settings"):
        app.prepare(make_cfg(*common))


def test_result_file_tail_repair(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}')  # complete row, newline lost
    assert read_rows(path) == [{"a": 1}, {"a": 2}] and path.read_text().endswith("}")  # reading changes nothing
    ResultWriter(path).append({"a": 3})
    assert read_rows(path) == [{"a": 1}, {"a": 2}, {"a": 3}]
    path.write_text('{"a": 1}\n{"a": 2')  # cut mid-row
    assert read_rows(path) == [{"a": 1}]
    ResultWriter(path).append({"a": 3})
    assert path.read_text() == '{"a": 1}\n{"a": 3}\n'
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')  # damage inside the file is an error
    with pytest.raises(ValueError, match="line 2"):
        read_rows(path)


def test_prompt_seed_depends_on_seed_and_id_only():
    assert prompt_seed(0, "a") == prompt_seed(0, "a")
    assert len({prompt_seed(0, "a"), prompt_seed(1, "a"), prompt_seed(0, "b")}) == 3


@pytest.fixture
def no_model_loading(monkeypatch):
    app._LOADED.clear()

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(app, "load_pair", refuse)


def test_bad_input_fails_before_loading(setup, tmp_path, no_model_loading):
    base = [*setup.base, f"out={tmp_path}"]
    other = tmp_path / "head_other_size"
    AcceptanceHead(16, 1, draft=setup.pair.draft).save_pretrained(other)
    with pytest.raises(ValueError, match="hidden_size 16"):
        app.run(make_cfg(*base, "method=specdecpp", f"method.head={other}"))
    renamed = tmp_path / "head_other_draft"
    AcceptanceHead(setup.pair.draft_hidden, 1, draft="someone/other-draft").save_pretrained(renamed)
    with pytest.raises(ValueError, match="allow_draft_mismatch"):
        app.run(make_cfg(*base, "method=specdecpp", f"method.head={renamed}"))
    job = app.prepare(make_cfg(*base, "method=specdecpp", f"method.head={renamed}", "method.allow_draft_mismatch=true"))
    assert job.spec.head.hidden_size == setup.pair.draft_hidden
    sampled = tmp_path / "head_t1_k50"
    AcceptanceHead(setup.pair.draft_hidden, 1, draft=setup.pair.draft).save_pretrained(
        sampled, training={"dataset_meta": {"sampling": {"temperature": 1.0, "top_k": 50, "top_p": 1.0}}})
    with pytest.raises(ValueError, match=r"temperature: 1.0 in training, 0.0 now; top_k: 50 in training, 0 now.*"
                                         r"method.allow_sampling_mismatch=true"):
        app.run(make_cfg(*base, "method=specdecpp", f"method.head={sampled}", "sampling=greedy"))
    with pytest.raises(ValueError, match=r"top_p: 1.0 in training, 0.9 now"):
        app.run(make_cfg(*base, "method=specdecpp", f"method.head={sampled}", "sampling=paper", "sampling.top_p=0.9"))
    app.prepare(make_cfg(*base, "method=specdecpp", f"method.head={sampled}", "sampling=paper"))
    app.prepare(make_cfg(*base, "method=specdecpp", f"method.head={sampled}", "sampling=greedy",
                         "method.allow_sampling_mismatch=true"))
    with pytest.raises(FileNotFoundError, match="no_such_head"):
        app.run(make_cfg(*base, "method=specdecpp", f"method.head={tmp_path}/no_such_head"))
    for method, cls, head in (("specdecpp", "SpecDecPP", [f"method.head={setup.head}"]), ("svip", "SVIP", [])):
        with pytest.raises(ValueError, match=rf"^{cls}: threshold must be a number in \[0, 1\], got 1.5\n"):
            app.run(make_cfg(*base, f"method={method}", *head, "method.threshold=1.5"))  # the constructor's words
    with pytest.raises(ValueError, match="HFAssisted: mode must be one of constant, heuristic, confidence, "
                                         "got 'fastest'"):
        app.run(make_cfg(*base, "method=hf_assisted", "method.mode=fastest"))
    with pytest.raises(ValueError, match="sampling=greedy"):
        app.run(make_cfg(*base, "method=oracle", "sampling=paper"))
    with pytest.raises(ValueError, match="FixedK: k must be an integer >= 1, got 0"):
        app.run(make_cfg(*base, "method=fixed_k", "method.k=0"))
    with pytest.raises(ValueError, match="SpecDecPP: min_candidates \\(5\\) > max_candidates \\(2\\)"):
        app.run(make_cfg(*base, "method=specdecpp", f"method.head={setup.head}", "method.min_candidates=5",
                         "method.max_candidates=2"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'tresh'"):  # a misspelt setting is named
        app.run(make_cfg(*base, "method=svip", "+method.tresh=0.3"))
    with pytest.raises(MissingConfigException, match="(?s)method/nope.*fixed_k.*specdecpp"):
        make_cfg(*base, "method=nope")
    with pytest.raises(Exception, match="pair.draft"):  # pair=custom needs the models named
        app.run(make_cfg(*[o for o in base if not o.startswith("pair.")], "method=target_only"))
    with pytest.raises(ValueError, match="comparison.nope"):
        sweep.expand_comparison({"nope": {}})
    # a list of grids for one method: constant lengths 1-2 beside the adaptive modes at 4
    grids = sweep.expand_comparison({"hf_assisted": [{"mode": "constant", "num_assistant_tokens": [1, 2]},
                                                     {"mode": ["heuristic", "confidence"], "num_assistant_tokens": 4}]})
    assert [(m.mode, m.num_assistant_tokens) for m in grids] == [
        ("constant", 1), ("constant", 2), ("heuristic", 4), ("confidence", 4)]


# -- method configs instantiate (conf/method/*.yaml carry _target_) ----------------------------------
def test_every_method_config_instantiates_its_class_with_its_settings(setup):
    """Each conf/method/*.yaml, composed as `python -m infer method=<name> method.<key>=...` would,
    builds the class its _target_ names with the configured settings (no model is loaded)."""
    from infer.hf_assisted import HFAssisted
    from infer.methods import (
        METHODS,
        PEARLMethod,
        SequoiaMethod,
        instantiate_method,
        resolve_method,
    )
    from infer.oracle import Oracle
    from specdecpp import SVIP, FixedK, TargetOnly

    assert sorted(p.stem for p in (CONF / "method").glob("*.yaml")) == sorted(METHODS)
    cases = {
        "target_only": ([], TargetOnly, {}),
        "fixed_k": (["method.k=7"], FixedK, {"k": 7}),
        "svip": (["method.threshold=0.45", "method.c=0.2", "method.max_candidates=9"], SVIP,
                 {"threshold": 0.45, "c": 0.2, "max_candidates": 9}),
        "specdecpp": ([f"method.head={setup.head}", "method.threshold=0.35", "method.min_candidates=2",
                       "method.max_candidates=11"], SpecDecPP,
                      {"threshold": 0.35, "min_candidates": 2, "max_candidates": 11, "head_depth": 1,
                       "head_kind": "resnet"}),
        "hf_assisted": (["method.mode=confidence", "method.num_assistant_tokens=5", "method.confidence_threshold=0.25"],
                        HFAssisted, {"mode": "confidence", "num_assistant_tokens": 5, "confidence_threshold": 0.25}),
        "oracle": ([], Oracle, {}),
        "pearl": (["method.gamma=3", "method.stop=svip", "method.threshold=0.6", "method.num_threads=2"], PEARLMethod,
                  {"gamma": 3, "stop": "svip", "threshold": 0.6, "c": 0.15, "num_threads": 2,
                   "switch_interval": 0.0001}),
        "sequoia": (["method.tree=[-1,0,0]"], SequoiaMethod, {"tree_size": 4, "tree_depth": 3, "parents": [-1, 0, 0],
                                                              "tree_source": "list", "expected_tokens": None}),
    }
    for name, (overrides, cls, settings) in cases.items():
        cfg = make_cfg(*setup.base, f"method={name}", *overrides)
        assert cfg.method.name == name
        objects = {"head": AcceptanceHead(setup.pair.draft_hidden, 1)} if name == "specdecpp" else {}
        assert type(instantiate_method(cfg.method, **objects)) is cls, name  # hydra.utils.instantiate
        spec = resolve_method(cfg.method, setup.pair.draft, SamplingConfig(temperature=0))
        assert type(spec.method) is cls, name
        assert {k: v for k, v in spec.settings.items() if k not in ("head", "head_sha")} == settings, name
    spec = resolve_method(make_cfg(*setup.base, "method=specdecpp", f"method.head={setup.head}").method,
                          setup.pair.draft, SamplingConfig(temperature=0))
    assert spec.method.head is spec.head and spec.head.draft == setup.pair.draft  # the loaded head, checked
    pearl = resolve_method(make_cfg("method=pearl", "method.stop=svip", "method.threshold=0.6").method, "d",
                           SamplingConfig()).method
    assert isinstance(pearl.policy, SVIP) and pearl.policy.threshold == 0.6


@pytest.mark.slow
def test_a_bad_method_setting_is_the_constructors_error_on_the_command_line(setup, tmp_path):
    """`python -m infer method=svip method.threshold=2`: the run stops before any model loads with
    the constructor's message, naming the setting; no result file is written."""
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "infer", *setup.base, "method=svip", "method.threshold=2", f"out={out}",
           f"hydra.run.dir={tmp_path}/hydra"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "SVIP: threshold must be a number in [0, 1], got 2" in done.stderr, done.stderr[-3000:]
    assert not out.exists()


def test_sweep_loads_models_once(setup, monkeypatch):
    app._LOADED.clear()
    calls = []
    real = app.load_pair
    monkeypatch.setattr(app, "load_pair", lambda *a: calls.append(a) or real(*a))
    cfg = make_cfg(*setup.base, "sampling=greedy", "max_new_tokens=3", f"out={setup.root}/sweep/${{method.name}}",
                   "~comparison.svip", "~comparison.specdecpp", "~comparison.hf_assisted", "comparison.fixed_k.k=[1,2]")
    summaries = sweep.run(cfg)
    assert [(s["method"], s["tag"], s["rows"]) for s in summaries] == [
        ("target_only", "base", 2), ("fixed_k", "k1", 2), ("fixed_k", "k2", 2), ("oracle", "oracle", 2)]
    assert len(calls) == 1
    paper = make_cfg(*setup.base, *(f"~comparison.{m}" for m in ("target_only", "fixed_k", "svip", "specdecpp",
                                                                  "hf_assisted")), f"out={setup.root}/sweep_paper")
    assert sweep.run(paper) == []  # the oracle needs greedy decoding: skipped


def test_interleaved_sweep_equals_the_sequential_one_and_runs_prompt_by_prompt(setup, monkeypatch):
    common = [*setup.base, "sampling=greedy", "max_new_tokens=4", "~comparison.svip", "~comparison.specdecpp",
              "~comparison.hf_assisted", "~comparison.oracle", "comparison.fixed_k.k=[1,3]"]
    seq = sweep.run(make_cfg(*common, f"out={setup.root}/seq/${{method.name}}"))
    calls = []
    real = app.make_row
    monkeypatch.setattr(app, "make_row",
                        lambda job, decoded, *a: calls.append((decoded.prompt.id, job.spec.tag))
                        or real(job, decoded, *a))
    inter = sweep.run(make_cfg(*common, "interleave=true", f"out={setup.root}/inter/${{method.name}}"))
    assert [(s["method"], s["tag"], s["rows"]) for s in inter] == [(s["method"], s["tag"], s["rows"]) for s in seq]
    # every method on the first prompt before any method on the second
    assert [tag for _, tag in calls[:3]] == ["base", "k1", "k3"] and len({p for p, _ in calls[:3]}) == 1
    for a, b in zip(seq, inter, strict=True):  # the same outputs and counts, row for row
        ra, rb = read_rows(Path(a["path"])), read_rows(Path(b["path"]))
        assert [(r["prompt_id"], r["output_ids"], r["n_draft"]) for r in ra] == \
            [(r["prompt_id"], r["output_ids"], r["n_draft"]) for r in rb]
    again = sweep.run(make_cfg(*common, "interleave=true", f"out={setup.root}/inter/${{method.name}}"))
    assert [s["rows"] for s in again] == [s["rows"] for s in inter]  # resumed: nothing redone


@pytest.mark.slow
def test_multirun_two_thresholds_writes_two_files(setup, tmp_path):
    out = tmp_path / "multirun"
    cmd = [sys.executable, "-m", "infer", "-m", *setup.base, "method=specdecpp", f"method.head={setup.head}",
           "method.threshold=0.3,0.9",
           "max_new_tokens=3", "warmup_tokens=0", "prompts.limit=1", f"out={out}",
           f"hydra.sweep.dir={tmp_path}/hydra"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in out.glob("*.jsonl"))
    assert files == ["head_h0.3_min1_max20__t1-k50-p1__s0.jsonl", "head_h0.9_min1_max20__t1-k50-p1__s0.jsonl"]
    assert [len(read_rows(out / f)) for f in files] == [1, 1]



# -- report -------------------------------------------------------------------------------------


def test_report_on_tiny_run(greedy_results, tmp_path):
    out, results = greedy_results
    report = build_report(out, tmp_path / "tiny_report")
    (group,) = report["groups"]
    assert {e["method"] for e in group["entries"]} == {"target_only", "fixed_k", "svip", "specdecpp",
                                                      "hf_assisted", "oracle"}
    assert group["fit"] is not None and group["fit"]["n_rows"] == 8  # 4 engine methods x 2 prompts
    assert {p.name.split("_")[0] for p in report["images"]} == {"pareto", "throughput"}
    assert all(p.stat().st_size > 5000 for p in report["images"])
    text = report["report"].read_text()
    assert "| oracle |" in text and "Cost model (Eq. 2.1" in text
    base = next(e for e in group["entries"] if e["method"] == "target_only")
    assert base["speedup"] == pytest.approx(1.0) and base["verification_rate"] == pytest.approx(1.0)
    assert not math.isnan(group["entries"][1]["discard_rate"])


def test_report_cli(greedy_results, tmp_path, capsys):
    out, _ = greedy_results
    report_main([str(out), "--out", str(tmp_path / "cli")])
    printed = capsys.readouterr().out
    assert "| target_only | - | 2 |" in printed and (tmp_path / "cli" / "report.md").is_file()
    with pytest.raises(SystemExit) as exc:
        report_main([str(tmp_path / "none")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err


# -- one EOS set for every stage ------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_eos_pair(setup, tmp_path_factory):
    """The tiny pair with a target whose generation_config.json lists two EOS ids: the tokenizer's
    and the 3rd token of the target's greedy answer to the "sea" prompt (so greedy decoding must
    stop after 3 tokens, on the second id, in every stage)."""
    import shutil

    from transformers import GenerationConfig

    from specdecpp import TargetOnly
    from specdecpp.core.sampling import SamplingConfig
    from specdecpp.data.prompts import encode_prompt
    from specdecpp.models.loading import load_model

    root = tmp_path_factory.mktemp("two_eos")
    target = root / "target"
    shutil.copytree(setup.pair.target, target)
    tok = setup.pair.tokenizer
    prompt = [encode_prompt(tok, "Write a short poem about the sea.")]
    model = load_model(str(target), "cpu")
    greedy = SpeculativeDecoder(model, model, TargetOnly(), SamplingConfig(temperature=0)).generate(
        torch.tensor(prompt), MAX_NEW).tokens[0, len(prompt[0]):].tolist()
    stop = greedy[2]
    assert stop not in greedy[:2] and stop != tok.eos_token_id
    GenerationConfig(eos_token_id=[tok.eos_token_id, stop], bos_token_id=tok.bos_token_id).save_pretrained(target)
    return type("TwoEos", (), {"target": str(target), "stop": stop, "greedy": greedy})


def test_eos_set_includes_every_generation_config_eos_id(setup, two_eos_pair):
    from specdecpp.models.loading import eos_token_ids

    target = load_model(two_eos_pair.target, "cpu")
    assert eos_token_ids(setup.pair.tokenizer, target) == {setup.pair.tokenizer.eos_token_id, two_eos_pair.stop}
    assert eos_token_ids(setup.pair.tokenizer) == {setup.pair.tokenizer.eos_token_id}


@pytest.mark.parametrize("method", ["target_only", "fixed_k", "hf_constant", "oracle"])
def test_every_runner_stops_on_the_second_generation_config_eos(setup, two_eos_pair, tmp_path, method):
    prompts = tmp_path / "sea.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n')
    base = [o for o in setup.base if not o.startswith(("pair.target=", "prompts.path="))]
    summary = app.run(make_cfg(*base, f"pair.target={two_eos_pair.target}", f"prompts.path={prompts}",
                               *GREEDY_METHODS[method], "sampling=greedy", f"out={tmp_path / 'out'}"))
    (row,) = read_rows(Path(summary["path"]))
    assert row["output_ids"] == two_eos_pair.greedy[:3], method


def test_data_gen_and_infer_end_responses_on_the_same_eos(setup, two_eos_pair, tmp_path):
    from datasets import load_from_disk

    from data_gen import run as generate

    prompts = tmp_path / "sea.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n')
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("data_gen", overrides=[
            f"pair.draft={setup.pair.draft}", f"pair.target={two_eos_pair.target}", "pair.device=cpu",
            "prompts=jsonl", f"prompts.path={prompts}", "sampling=greedy", f"out={tmp_path / 'data'}",
            f"max_new_tokens={MAX_NEW}", "progress=false"])
    generate(cfg)
    assert load_from_disk(str(tmp_path / "data" / "train"))["target_ids"] == [two_eos_pair.greedy[:3]]


# -- the pair from the head -----------------------------------------------------------------------
def test_pair_comes_from_the_heads_config(setup, tmp_path):
    """`python -m infer method=specdecpp method.head=DIR` with no pair.*; infer.sweep too."""
    head = tmp_path / "head"
    AcceptanceHead(setup.pair.draft_hidden, 1, draft=setup.pair.draft).save_pretrained(head, target=setup.pair.target)
    base = [o for o in setup.base if not o.startswith("pair.")]
    summary = app.run(make_cfg(*base, "method=specdecpp", f"method.head={head}", "sampling=greedy",
                               f"out={tmp_path / 'one'}"))
    rows = read_rows(Path(summary["path"]))
    assert [r["pair"]["draft"] for r in rows] == [setup.pair.draft] * 2
    assert [r["pair"]["target"] for r in rows] == [setup.pair.target] * 2
    reference = app.run(make_cfg(*setup.base, "method=target_only", "sampling=greedy", f"out={tmp_path / 'ref'}"))
    assert [r["output_ids"] for r in rows] == [r["output_ids"] for r in read_rows(Path(reference["path"]))]

    summaries = sweep.run(make_cfg(*base, "sampling=greedy", f"out={tmp_path}/sweep/${{method.name}}",
                                   "~comparison.svip", "~comparison.hf_assisted", "~comparison.oracle",
                                   "comparison.fixed_k.k=[2]", f"comparison.specdecpp.head={head}",
                                   "comparison.specdecpp.threshold=[0.5]"))
    assert [s["method"] for s in summaries] == ["target_only", "fixed_k", "specdecpp"]
    for s in summaries:
        assert {r["pair"]["target"] for r in read_rows(Path(s["path"]))} == {setup.pair.target}

    # an explicit pair.draft wins, checked
    with pytest.raises(ValueError, match="trained on draft .* but draft .*target"):
        app.prepare(make_cfg(*base, "method=specdecpp", f"method.head={head}", f"pair.draft={setup.pair.target}"))
    bare = tmp_path / "bare_head"  # a head that records no target
    AcceptanceHead(setup.pair.draft_hidden, 1, draft=setup.pair.draft).save_pretrained(bare)
    with pytest.raises(ValueError, match="pair.target is not set and head .* records no target"):
        app.prepare(make_cfg(*base, "method=specdecpp", f"method.head={bare}"))
    with pytest.raises(ValueError, match="pair.draft is not set"):
        app.prepare(make_cfg(*base, "method=fixed_k"))


def test_batch_size_rows_record_it_and_greedy_outputs_equal_batch_one(setup):
    """batch_size=2 (continuous batching over the prompts): the rows record the batch size and
    their call, the file tag says _b2, greedy outputs equal batch size 1's, target-only batched too;
    the report compares each method with target-only at the same batch size."""
    common = [*setup.base, "sampling=greedy", "~comparison.svip", "~comparison.specdecpp",
              "~comparison.hf_assisted", "~comparison.oracle", "comparison.fixed_k.k=[2]"]
    one = sweep.run(make_cfg(*common, f"out={setup.root}/b1/${{method.name}}"))
    two = sweep.run(make_cfg(*common, "batch_size=2", "interleave=true", f"out={setup.root}/b2/${{method.name}}"))
    for a, b in zip(one, two, strict=True):
        assert Path(b["path"]).name.startswith(Path(a["path"]).name.split("__")[0] + "_b2__")
        ra, rb = read_rows(Path(a["path"])), read_rows(Path(b["path"]))
        assert [(r["prompt_id"], r["output_ids"]) for r in ra] == [(r["prompt_id"], r["output_ids"]) for r in rb]
        assert all(r["batch_size"] == 2 and r["batch_wall_time_s"] > 0 and r["batch_id"] for r in rb)
        assert all(r["batch_size"] == 1 and "batch_id" not in r for r in ra)
        assert b["tokens_per_s"] > 0
    groups = summarize_results(read_result_dir(setup.root / "b2"))
    assert [g["batch_size"] for g in groups] == [2]
    assert {e["method"] for e in groups[0]["entries"]} == {"target_only", "fixed_k"}
    assert all(e["speedup"] is not None for e in groups[0]["entries"])
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        app.prepare(make_cfg(*setup.base, "method=fixed_k", "batch_size=0"))
    with pytest.raises(ValueError, match="decodes one prompt at a time"):
        app.prepare(make_cfg(*setup.base, "method=hf_assisted", "batch_size=2"))


def test_batch_fill_rows_and_the_batched_eq23(setup):
    """batch_fill=true: the file tag says _b2_fill, rows record it and their call's rounds, greedy
    outputs are still the target's (batch 1's); with t_draft(B) / t_target(B, n) in costs the report
    predicts each method's speedup from its calls' rounds (recomputed here by hand)."""
    common = [*setup.base, "sampling=greedy", "~comparison.fixed_k", "~comparison.specdecpp",
              "~comparison.hf_assisted", "~comparison.oracle", "comparison.svip.threshold=[0.9]"]
    one = sweep.run(make_cfg(*common, f"out={setup.root}/fill1/${{method.name}}"))
    two = sweep.run(make_cfg(*common, "batch_size=2", "batch_fill=true", f"out={setup.root}/fill2/${{method.name}}"))
    rows = {}
    for a, b in zip(one, two, strict=True):
        assert Path(b["path"]).name.startswith(Path(a["path"]).name.split("__")[0] + "_b2_fill__")
        ra, rb = read_rows(Path(a["path"])), read_rows(Path(b["path"]))
        assert [r["output_ids"] for r in ra] == [r["output_ids"] for r in rb]
        assert all(r["batch_fill"] is True and r["batch_rounds"] and all(len(x) == 3 for x in r["batch_rounds"])
                   for r in rb)
        assert all("batch_fill" not in r for r in ra)  # absent when false: older files still resume
        rows[rb[0]["method"]] = rb
    t_draft = {1: 0.01, 2: 0.012}
    t_target = {b: {n: 0.1 + 0.02 * b * n for n in range(1, 8)} for b in (1, 2)}
    costs = Costs(0.01, 0.12, t_target[1], {}, target_by_batch=t_target, draft_by_batch=t_draft)

    def by_hand(rs):  # seconds per token: each call once, K_max t_draft(B) + t_target(B, K_max + 1) per round
        call = {r["batch_id"]: r["batch_rounds"] for r in rs}
        secs = sum(d * t_draft[b] + t_target[b][k + 1] for rounds in call.values() for b, k, d in rounds)
        return secs / sum(r["n_generated"] for r in rs)

    [group] = summarize_results(read_result_dir(setup.root / "fill2"), costs)
    entries = {e["method"]: e for e in group["entries"]}
    assert entries["svip"]["tag"].endswith("+fill")
    want = by_hand(rows["target_only"]) / by_hand(rows["svip"])
    assert entries["svip"]["speedup_width_predicted"] == pytest.approx(want, rel=1e-9)
    assert entries["target_only"]["speedup_width_predicted"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="batch_fill must be true or false"):
        app.prepare(make_cfg(*setup.base, "method=fixed_k", "batch_size=2", "batch_fill=3"))


# -- infer: both kinds side by side ---------------------------------------------------------------------
def test_infer_sweep_runs_both_head_kinds_side_by_side(tiny_pair, tmp_path):
    """``infer.sweep`` with a paper head and a lag-free head: greedy output equal to target-only for
    both, rows record the kind, the lag-free head's rounds may have one candidate, the report names
    both."""
    from hydra import compose, initialize_config_dir

    from infer import sweep
    from infer.report import build_report
    from infer.results import read_rows

    conf = CONF
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n'
                       '{"id": "math", "prompt": "What is 12 times 7?"}\n')
    AcceptanceHead(32, 1, draft=tiny_pair.draft).save_pretrained(tmp_path / "paper")
    ConstantNext(32, -20.0).save_pretrained(tmp_path / "free")  # forced low: one candidate per round
    cfg_file = tmp_path / "free" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["draft"] = tiny_pair.draft
    cfg_file.write_text(json.dumps(cfg))
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("infer", overrides=[
            f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "prompts=jsonl",
            f"prompts.path={prompts}", "max_new_tokens=8", "warmup_tokens=0", "progress=false", "sampling=greedy",
            f"out={tmp_path}/res/${{method.name}}", "~comparison.svip", "~comparison.hf_assisted", "~comparison.oracle",
            "~comparison.fixed_k", "~comparison.specdecpp",
            f"+comparison.specdecpp=[{{head:{tmp_path / 'paper'},threshold:0.5}},"
            f"{{head:{tmp_path / 'free'},threshold:0.5}}]"])
    summaries = sweep.run(cfg)
    rows = {s["method"] + ":" + Path(s["path"]).name: read_rows(Path(s["path"])) for s in summaries}
    reference = next(r for k, r in rows.items() if k.startswith("target_only"))
    kinds = {}
    for key, rs in rows.items():
        assert [r["output_ids"] for r in rs] == [r["output_ids"] for r in reference], key
        if key.startswith("specdecpp"):
            kinds[rs[0]["settings"]["head_kind"]] = rs
    assert set(kinds) == {"resnet", "next"}
    assert all(set(r["candidate_lengths"][:-1]) <= {1} for r in kinds["next"])
    assert any(max(r["candidate_lengths"]) >= 2 for r in kinds["resnet"])
    build_report(tmp_path / "res", tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "free_h0.5" in text and "paper_h0.5" in text


def test_a_pair_named_by_other_paths_to_the_same_directories_is_the_same_run(tmp_path, monkeypatch):
    """Rows written with the pair's models named by relative paths resume a run that names them by absolute
    ones (two spellings of SPECDECPP_CACHE); another directory, another pair name or other settings do not."""
    from infer.results import check_resumable, same_run_value

    for role in ("draft", "target", "other"):
        (tmp_path / "cache" / role).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    written = {"name": "demo", "draft": "cache/draft", "target": "cache/target"}
    now = {"name": "demo", "draft": str(tmp_path / "cache" / "draft"), "target": str(tmp_path / "cache" / "target")}
    assert same_run_value("pair", written, now)
    assert not same_run_value("pair", written, {**now, "target": str(tmp_path / "cache" / "other")})
    assert not same_run_value("pair", written, {**now, "name": "other"})
    assert not same_run_value("pair", {**written, "draft": "org/a"}, {**now, "draft": "org/b"})  # hub ids
    assert not same_run_value("settings", "cache/draft", now["draft"])  # only a pair's models are resolved
    row = {"method": "fixed_k", "pair": written, "max_new_tokens": 8}
    check_resumable(tmp_path / "r.jsonl", [row], {**row, "pair": now})  # no error
    with pytest.raises(ValueError, match="different pair"):
        check_resumable(tmp_path / "r.jsonl", [row], {**row, "pair": {**now, "draft": "elsewhere"}})


def test_resume_refuses_a_result_file_of_edited_prompts(setup, tmp_path, caplog):
    """Issue 64 row 1, infer's side: rows record their prompt's digest; a resume after a prompt's
    text was edited under the same id is refused naming the id and both digests, the file left
    untouched. Rows written before digests were recorded are trusted, with a warning."""
    from specdecpp.data.prompts import Prompt, prompt_digest

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(setup.prompts.read_text())
    common = [*setup.base, f"prompts.path={prompts}", "method=fixed_k", "method.k=2", "warmup_tokens=0",
              f"out={tmp_path}/out"]
    path = Path(app.run(make_cfg(*common, "prompts.limit=1"))["path"])
    before = path.read_text()
    assert read_rows(path)[0]["prompt_digest"] == prompt_digest(Prompt("sea", "Write a short poem about the sea."))
    prompts.write_text(prompts.read_text().replace("about the sea", "about the moon"))
    old, new = (prompt_digest(Prompt("sea", f"Write a short poem about the {w}.")) for w in ("sea", "moon"))
    with pytest.raises(ValueError, match=rf"holds a row for prompt 'sea' decoded from another text: its digest there "
                                         rf"is {old}, the prompts now give {new}.*choose another out= directory"):
        app.prepare(make_cfg(*common))
    assert path.read_text() == before
    legacy = {k: v for k, v in read_rows(path)[0].items() if k != "prompt_digest"}  # as written before digests
    path.write_text(json.dumps(legacy) + "\n")
    with caplog.at_level("WARNING", logger="infer.results"):
        job = app.prepare(make_cfg(*common))
    assert [q.id for q in job.todo] == ["math"] and "1 row(s) were written before prompt digests" in caplog.text


def test_a_prompt_longer_than_the_context_is_refused_before_decoding(setup, tmp_path, monkeypatch):
    """Issue 64 row 4, infer's side: a prompt whose tokens plus max_new_tokens pass the pair's
    max_position_embeddings (512 here) is refused naming its id, length and the limit before any
    prompt is decoded; long_prompts=skip decodes the others and warns, naming it."""
    from specdecpp.data.prompts import encode_prompt

    text = "Summarise this: " + "the sea is wide and deep " * 120
    n = len(encode_prompt(setup.pair.tokenizer, text))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(setup.prompts.read_text() + json.dumps({"id": "huge", "prompt": text}) + "\n")
    common = [*setup.base, f"prompts.path={prompts}", "method=target_only", "warmup_tokens=0", f"out={tmp_path}/out"]
    with pytest.raises(ValueError, match=rf"infer prompts 'jsonl': prompt 'huge' is {n} tokens long \(chat template "
                                         rf"applied\); with max_new_tokens={MAX_NEW} it needs {n + MAX_NEW} positions, "
                                         r"more than the pair's context of 512 \(max_position_embeddings of the "
                                         r"draft\).*long_prompts=skip"):
        app.run(make_cfg(*common))
    assert not list((tmp_path / "out").rglob("*.jsonl")) or not read_result_dir(tmp_path / "out")
    with pytest.raises(ValueError, match="long_prompts must be one of error, skip, got 'drop'"):
        app.prepare(make_cfg(*common, "long_prompts=drop"))
    with pytest.warns(UserWarning, match=rf"skipping 1 prompt\(s\) .*'huge' \({n} tokens\) \(long_prompts=skip\)"):
        summary = app.run(make_cfg(*common, "long_prompts=skip"))
    assert [r["prompt_id"] for r in read_rows(Path(summary["path"]))] == ["sea", "math"]
