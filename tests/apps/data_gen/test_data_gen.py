"""data_gen: labels against an independent recomputation, resume, sharding, batching, bad input,
the command line and Hydra's launchers. The labelling library: tests/data/test_labels.py; the
dataset on disk: tests/data/test_dataset.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import data_gen.app
from data_gen import run
from specdecpp.core.sampling import SamplingConfig, sample, warp
from specdecpp.data.dataset import PROMPTS_FILE, DatasetError, load_labelled, shard_done
from specdecpp.data.prompts import Prompt, encode_prompt, prompt_digest
from specdecpp.models.loading import load_model
from tests.helpers.data_gen import PROMPTS, make_cfg, recompute_row
from tests.helpers.paths import REPO
from tests.helpers.tiny import perturbed_feature_draft

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


def test_fast_sampling_gives_the_same_data(tiny_pair, prompts_file, baseline, tmp_path):
    """fast=static: the target samples on the fast path's static batch runner; the same data (to
    float rounding), recorded in the meta."""
    out = tmp_path / "fast"
    run(make_cfg(tiny_pair, prompts_file, out, "fast=static"))
    assert_same_data(baseline, out, exact=False)
    assert load_labelled(out)[1]["fast"] == "static" and load_labelled(baseline)[1]["fast"] is None


def test_consolidate_only_finishes_a_sharded_run(tiny_pair, prompts_file, baseline, tmp_path):
    out = tmp_path / "consolidate"
    assert not run(make_cfg(tiny_pair, prompts_file, out, "shard.index=0", "shard.count=2")).complete
    (out / data_gen.app.LOCK_FILE).touch()  # as if another process were consolidating
    assert not run(make_cfg(tiny_pair, prompts_file, out, "shard.index=1", "shard.count=2")).complete
    (out / data_gen.app.LOCK_FILE).unlink()
    result = run(make_cfg(tiny_pair, prompts_file, out, "consolidate_only=true"))
    assert result.complete and result.n_prompts == 0
    assert_same_data(baseline, out)


def test_changed_settings_against_existing_out_is_an_error(tiny_pair, prompts_file, baseline):
    with pytest.raises(ValueError, match=r"other settings \(seed: existing 0 vs now 1\)"):
        run(make_cfg(tiny_pair, prompts_file, baseline, "seed=1"))
    with pytest.raises(ValueError, match="sampling"):
        run(make_cfg(tiny_pair, prompts_file, baseline, "sampling=greedy"))


def test_a_dataset_started_under_another_sampler_is_not_resumed(tiny_pair, prompts_file, baseline, tmp_path):
    """The meta records the draw (specdecpp.core.sampling.SAMPLER); a dataset begun before it was recorded
    (torch.multinomial's stream) is not finished with another draw, while a complete one still loads."""
    from specdecpp.core.sampling import SAMPLER
    from specdecpp.data.dataset import read_meta, write_meta

    assert load_labelled(baseline)[1]["sampler"] == SAMPLER == "inverse_cdf"
    out = tmp_path / "old_sampler"
    run(make_cfg(tiny_pair, prompts_file, out, "shard.index=1", "shard.count=2"))
    meta = read_meta(out)
    del meta["sampler"]  # as data_gen wrote it before the draw was recorded
    write_meta(out, meta)
    with pytest.raises(ValueError, match=r"other settings \(sampler: existing None vs now 'inverse_cdf'\)"):
        run(make_cfg(tiny_pair, prompts_file, out, "shard.index=0", "shard.count=2"))
    done = tmp_path / "old_complete"
    shutil.copytree(baseline, done)
    meta = read_meta(done)
    del meta["sampler"]
    write_meta(done, meta)
    result = run(make_cfg(tiny_pair, prompts_file, done))
    assert result.complete and result.n_prompts == 0


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
    with pytest.raises(ValueError, match="data_gen: fast must be one of None, 'static', 'compile', 'graphs', "
                                         "'compile-graphs', got 'turbo'"):
        run(make_cfg(tiny_pair, prompts_file, out, "fast=turbo"))
    with pytest.raises(ValueError, match="data_gen: fast='graphs' needs CUDA; the models are on cpu"):
        run(make_cfg(tiny_pair, prompts_file, out, "pair.device=cpu", "fast=graphs"))
    with pytest.raises(ValueError, match="data_gen: fast='compile-graphs' needs CUDA; the models are on cpu"):
        run(make_cfg(tiny_pair, prompts_file, out, "pair.device=cpu", "fast=compile-graphs"))
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


@pytest.mark.slow
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


@pytest.mark.slow
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




def rewrite_prompt(path, pid, text):
    """Edit one prompt of a JSONL file in place, keeping its id (issue 64, row 1)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        if row["id"] == pid:
            old, row["prompt"] = row["prompt"], text
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return old


def test_resume_refuses_prompts_edited_in_place(tiny_pair, prompts_file, tmp_path):
    """Issue 64 row 1: a resume (shard.index=1 after shard.index=0, or a rerun of a finished run)
    after a prompt's text was edited under the same id is refused, naming the id and both digests;
    with the original text back it resumes and finishes, and a finished run is then left alone."""
    path = tmp_path / "prompts.jsonl"
    shutil.copy(prompts_file, path)
    out = tmp_path / "data"
    run(make_cfg(tiny_pair, path, out, "shard.index=0", "shard.count=2"))  # train/0 (t0, t1) and train/2 (t4)
    original = rewrite_prompt(path, "t1", "Explain how a hash map works.")
    before, after = (prompt_digest(Prompt("t1", text)) for text in (original, "Explain how a hash map works."))
    fix = rf"choose another out= directory \(or delete '{out}' to relabel everything\)"
    with pytest.raises(ValueError, match=rf"already holds labels for prompt 't1' made from another text: its digest "
                                         rf"there is {before}, the prompts now give {after}.*{fix}"):
        run(make_cfg(tiny_pair, path, out, "shard.index=1", "shard.count=2"))
    assert not shard_done(out, "train", 1)  # refused before labelling anything
    rewrite_prompt(path, "t3", "def sub(a, b):")  # not labelled yet (train/1): free to change
    rewrite_prompt(path, "t1", original)
    result = run(make_cfg(tiny_pair, path, out, "shard.index=1", "shard.count=2"))
    assert result.complete and result.n_prompts == 4
    rows = {r["id"]: r["prompt"] for ds in load_labelled(out)[0].values() for r in ds}
    assert rows["t1"] == original and rows["t3"] == "def sub(a, b):" and len(rows) == 7
    assert json.loads((out / PROMPTS_FILE).read_text())["splits"]["train"][1] == ["t1", before]

    rewrite_prompt(path, "d0", "A brand new prompt.")  # the finished run is not "nothing to do" any more
    with pytest.raises(ValueError, match=rf"prompt 'd0' made from another text.*{fix}"):
        run(make_cfg(tiny_pair, path, out))
    path.write_text(path.read_text().replace("A brand new prompt.", PROMPTS[5][2]))
    assert run(make_cfg(tiny_pair, path, out)).n_prompts == 0
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")  # the same texts, reordered
    with pytest.raises(ValueError, match=r"split 'train' holds 5 labelled prompt\(s\), but the prompts of this run put "
                                         r"5 there, the first difference at position 0 \('t0' there, 't1' now\): "
                                         r"prompts were added, removed or reordered"):
        run(make_cfg(tiny_pair, path, out))


def test_outputs_written_before_prompt_digests_are_checked_from_their_rows(tiny_pair, prompts_file, baseline, tmp_path):
    """Shards and datasets made before digests were recorded (no "prompts" in the .done markers, no
    prompt_digests.json) are checked against the prompt texts their rows store: the same prompts
    resume, an edited one is refused."""
    path = tmp_path / "prompts.jsonl"
    shutil.copy(prompts_file, path)
    out = tmp_path / "old"
    run(make_cfg(tiny_pair, path, out, "shard.index=0", "shard.count=2"))
    for marker in (out / "shards").rglob("*.done"):
        legacy = json.loads(marker.read_text())
        del legacy["prompts"]
        marker.write_text(json.dumps(legacy))
    original = rewrite_prompt(path, "t4", "Name a colour.")
    with pytest.raises(ValueError, match="already holds labels for prompt 't4' made from another text"):
        run(make_cfg(tiny_pair, path, out, "shard.index=1", "shard.count=2"))
    rewrite_prompt(path, "t4", original)
    assert run(make_cfg(tiny_pair, path, out, "shard.index=1", "shard.count=2")).complete
    (out / PROMPTS_FILE).unlink()
    assert run(make_cfg(tiny_pair, path, out)).n_prompts == 0
    rewrite_prompt(path, "t0", "Write a short poem about the moon.")
    with pytest.raises(ValueError, match="already holds labels for prompt 't0' made from another text"):
        run(make_cfg(tiny_pair, path, out))


def long_prompts_file(tmp_path, tokenizer):
    """The fixture's train prompts plus one of more than the tiny pair's 512 positions (issue 64 row 4)."""
    path = tmp_path / "long.jsonl"
    text = "Summarise this: " + "the sea is wide and deep " * 120
    rows = [{"id": i, "prompt": p} for i, s, p in PROMPTS if s == "train"][:3] + [{"id": "huge", "prompt": text}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, len(encode_prompt(tokenizer, text))


def test_a_prompt_longer_than_the_context_is_refused_before_any_model_runs(tiny_pair, tmp_path, monkeypatch):
    """Issue 64 row 4: a prompt whose tokens plus max_new_tokens pass max_position_embeddings is
    refused, naming its id, its length and the limit, before any sampling; long_prompts=skip leaves
    it out with a warning naming it, and records it in the meta."""
    path, n = long_prompts_file(tmp_path, tiny_pair.tokenizer)
    assert n + 8 > 512
    monkeypatch.setattr(data_gen.app, "sample_responses_with_probs",
                        lambda *a, **k: pytest.fail("sampled before the length check"))
    out = tmp_path / "long"
    with pytest.raises(ValueError, match=rf"prompt 'huge' is {n} tokens long \(chat template applied\); with "
                                         rf"max_new_tokens=8 it needs {n + 8} positions, more than the pair's context "
                                         r"of 512 \(max_position_embeddings of the draft\).*long_prompts=skip"):
        run(make_cfg(tiny_pair, path, out, "splits=null"))
    assert not out.exists()
    with pytest.raises(ValueError, match="long_prompts must be one of error, skip, got 'drop'"):
        run(make_cfg(tiny_pair, path, out, "splits=null", "long_prompts=drop"))
    monkeypatch.undo()
    with pytest.warns(UserWarning, match=rf"skipping 1 prompt\(s\) longer than the pair's context of 512 .*'huge' "
                                         rf"\({n} tokens\)"):
        result = run(make_cfg(tiny_pair, path, out, "splits=null", "long_prompts=skip"))
    assert result.complete and result.rows == {"train": 3}
    splits, meta = load_labelled(out)
    assert "huge" not in splits["train"]["id"] and meta["skipped_prompts"] == {"huge": n}
    assert meta["long_prompts"] == "skip"
    assert run(make_cfg(tiny_pair, path, out, "splits=null", "long_prompts=skip")).n_prompts == 0
    with pytest.raises(ValueError, match=r"other settings \(long_prompts: existing .skip. vs now .error.\)"):
        run(make_cfg(tiny_pair, path, out, "splits=null"))


def test_a_feature_draft_is_labelled_at_each_depth(tiny_pair, prompts_file, models, tmp_path):
    """A feature draft (EAGLE-3, speculators format) through data_gen: each row carries its labels at
    depths 1..D (feature_depths), depth 1 in the plain columns, each depth's labels equal to
    label_responses' on the same response and generator (its own test checks them against
    drafting with a cache), the meta records D, and the dataset loads."""
    from specdecpp.data.labels import label_responses, prompt_generator
    from specdecpp.models.feature_draft import FeatureDraft

    target = models[1]
    draft = perturbed_feature_draft(target)
    draft.save_pretrained(tmp_path / "feature")
    out = tmp_path / "data"
    run(make_cfg(tiny_pair, prompts_file, out, f"pair.draft={tmp_path / 'feature'}", "feature_depths=3",
                 "limit={train:2,dev:1}"))
    splits, meta = load_labelled(out)
    assert meta["feature_depths"] == 3
    sampling = SamplingConfig(1.0, 50, 1.0)
    draft = FeatureDraft.from_pretrained(tmp_path / "feature", target=target)
    for row in (r for ds in splits.values() for r in ds):
        n = len(row["target_ids"])
        assert [len(d) for d in row["depth_p_acc"]] == [3] * n and len(row["depth_draft_ids"]) == n
        assert [d[0] for d in row["depth_p_acc"]] == row["p_acc"]
        assert [d[0] for d in row["depth_draft_ids"]] == row["draft_ids"]
        gen = prompt_generator(meta["seed"], row["id"])
        with torch.no_grad():  # the response's own draws come first: replay them to reach the labels' draws
            for i in range(n):
                prefix = row["prompt_ids"] + row["target_ids"][:i]
                sample(warp(target(torch.tensor([prefix])).logits[0, -1], sampling), gen)
        (lab,) = label_responses(draft, target, [row["prompt_ids"]], [row["target_ids"]], sampling, [gen], depths=3)
        assert torch.equal(lab.depth_draft_ids, torch.tensor(row["depth_draft_ids"]))
        torch.testing.assert_close(lab.depth_p_acc, torch.tensor(row["depth_p_acc"]), atol=1e-5, rtol=1e-5,
                                   equal_nan=True)
    # the potential tool reads each round's j-th candidate at depth j and reports mean P by depth
    import numpy as np

    from infer import potential

    config = potential.PotentialConfig(split="train", seeds=2, max_k=3, thresholds=(0.5,), svip_thresholds=(0.3,),
                                       n_boot=20, quiet=True, cost_ratio=0.1)
    potential.run(str(out), config, out=str(tmp_path / "pot"))
    context = json.loads((tmp_path / "pot" / "potential.json").read_text())["context"]
    deep = np.concatenate([np.array(r["depth_p_acc"], dtype=float) for r in splits["train"]])
    assert context["mean_p_acc_by_depth"] == pytest.approx(list(np.nanmean(deep, axis=0)))
    assert context["mean_p_acc"] == pytest.approx(context["mean_p_acc_by_depth"][0])
    assert "at depths 1..3" in (tmp_path / "pot" / "potential.md").read_text()

