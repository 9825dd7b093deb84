"""train's bad input: bad settings, missing paths, damaged or mismatched datasets, joined datasets of
another pair; each named before anything is written."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.helpers.train import COLUMNS, base_overrides, random_rows, save_dataset, train_cfg
from train import run
from train.checks import check_draft_matches


@pytest.mark.parametrize("override, message", [
    ("loss.w_rej=0", "w_rej must be > 0"),
    ("loss.w_rej=-3", "w_rej must be > 0"),
    ("data.remix_each_epoch=true", "set one of them to false"),
    ("data.mix_ratio=1.5", r"mix_ratio must be in \[0, 1\)"),
])
def test_bad_settings_fail_before_anything_is_written(tiny_dataset, tiny_pair, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        run(train_cfg([*base_overrides(tiny_pair, tiny_dataset, tmp_path), override]))
    assert not (tmp_path / "head").exists() and not (tmp_path / "cache").exists()


def test_missing_draft_or_dataset_path_is_named(tiny_pair, tmp_path):
    data = save_dataset(tmp_path / "data", {"train": random_rows(4, tiny_pair.vocab, 0)}, None, 32, tiny_pair.vocab)
    with pytest.raises(ValueError, match="pair.draft is not set and dataset .* records no draft"):
        run(train_cfg([f"data.path={data}", f"out={tmp_path / 'head'}"]))
    with pytest.raises(ValueError, match="data.path is not set"):
        run(train_cfg(["pair.draft=somewhere", f"out={tmp_path / 'head'}"]))
    assert not (tmp_path / "head").exists()


def corrupt(rows: dict, column: str, value) -> dict:
    rows = {k: [list(v) if isinstance(v, list) else v for v in vs] for k, vs in rows.items()}
    rows[column][1][2] = value
    return rows


@pytest.mark.parametrize("case, message", [
    ("empty_split", "a split has no rows|split 'train' .* is empty"),
    ("no_response_tokens", "split 'dev' .* has no response tokens"),
    ("nan", "split 'train': p_acc has non-finite values"),
    ("above_one", r"split 'dev': p_acc must lie in \[0, 1\]"),
    ("lengths_differ", "split 'train' row 1 .*: draft_ids has 3 entries but target_ids has"),
    ("unfinished", "data_gen did not finish"),
    ("token_out_of_vocab", "outside the draft's vocabulary"),
    ("other_draft", "does not match the configured draft.*allow_draft_mismatch"),
    ("missing", "directory not found; run data_gen first"),
])
def test_bad_datasets_get_clear_errors(tiny_pair, tmp_path, case, message):
    good = random_rows(4, tiny_pair.vocab, 0)
    splits = {"train": good, "dev": good}
    draft, hidden = tiny_pair.draft, 32
    if case == "empty_split":
        splits["train"] = {k: [] for k in COLUMNS}
    elif case == "no_response_tokens":
        splits["dev"] = {k: [[] if k in ("target_ids", "draft_ids", "p_acc", "draft_entropy") else v
                             for v in vs] for k, vs in good.items()}
    elif case == "nan":
        splits["train"] = corrupt(good, "p_acc", float("nan"))
    elif case == "above_one":
        splits["dev"] = corrupt(good, "p_acc", 1.5)
    elif case == "token_out_of_vocab":
        splits["train"] = corrupt(good, "draft_ids", tiny_pair.vocab + 5)
    elif case == "lengths_differ":
        splits["train"] = {**good, "draft_ids": [v if j != 1 else [5, 6, 7] for j, v in enumerate(good["draft_ids"])]}
    elif case == "other_draft":
        draft, hidden = "someone/other-draft", 64
    data = tmp_path / "data"
    if case != "missing":
        save_dataset(data, splits, draft, hidden, tiny_pair.vocab)
        if case == "unfinished":
            meta = json.loads((data / "specdecpp_meta.json").read_text())
            (data / "specdecpp_meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        run(train_cfg(base_overrides(tiny_pair, data, tmp_path)))
    assert not (tmp_path / "head").exists()


@pytest.mark.parametrize("keep", [0, 100, 0.5])
def test_a_damaged_arrow_file_is_named_with_how_to_regenerate(tiny_pair, tmp_path, keep):
    data = save_dataset(tmp_path / "data", {"train": random_rows(30, tiny_pair.vocab, 0),
                                            "dev": random_rows(6, tiny_pair.vocab, 1)},
                        tiny_pair.draft, 32, tiny_pair.vocab)
    arrow = next((data / "train").glob("*.arrow"))
    size = arrow.stat().st_size
    arrow.write_bytes(arrow.read_bytes()[: int(size * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=rf"the dataset is damaged: {arrow} \(split 'train'\) cannot be read.*"
                                         r"rerun the data_gen command that made it") as error:
        run(train_cfg(base_overrides(tiny_pair, data, tmp_path)))
    assert "pyarrow" not in str(error.value)
    assert not (tmp_path / "head").exists()


def test_draft_mismatch_can_be_overridden_for_a_renamed_draft(tiny_pair):
    meta = {"draft": "/somewhere/else/draft", "draft_hidden_size": 32}
    with pytest.raises(ValueError, match="made with draft '/somewhere/else/draft'"):
        check_draft_matches(meta, tiny_pair.draft, 32, "DIR", allow_mismatch=False)
    check_draft_matches(meta, tiny_pair.draft, 32, "DIR", allow_mismatch=True)
    check_draft_matches({"draft": tiny_pair.draft + "/", "draft_hidden_size": 32}, tiny_pair.draft, 32, "DIR", False)


@pytest.mark.parametrize("case, message", [
    ("sampling", r"differ in sampling"),
    ("draft", r"differ in draft"),
    ("leak", r"1 prompt\(s\) of the joined 'dev' split are also in 'train'"),
    ("empty", "data.path is an empty list"),
])
def test_joining_datasets_of_another_pair_or_with_leaked_prompts_is_refused(tiny_pair, tmp_path, case, message):
    vocab = tiny_pair.vocab
    dev = random_rows(4, vocab, 2)
    a = save_dataset(tmp_path / "a", {"train": random_rows(6, vocab, 1), "dev": dev}, tiny_pair.draft, 32, vocab)
    b_train = random_rows(6, vocab, 3)
    if case == "leak":  # B labelled one of A's dev prompts as training data
        b_train = {k: [*v[:-1], dev[k][0]] for k, v in b_train.items()}
    b = save_dataset(tmp_path / "b", {"train": b_train}, tiny_pair.target if case == "draft" else tiny_pair.draft,
                     32, vocab)
    if case == "sampling":
        meta = json.loads((b / "specdecpp_meta.json").read_text())
        (b / "specdecpp_meta.json").write_text(json.dumps({**meta, "sampling": {**meta["sampling"], "top_k": 0}}))
    with pytest.raises(ValueError, match=message):
        run(train_cfg([*base_overrides(tiny_pair, a, tmp_path), "data.path=[]" if case == "empty" else
                       f"data.path=[{a},{b}]"]))
    assert not (tmp_path / "head").exists() and not (tmp_path / "cache").exists()


def test_the_same_dataset_named_twice_in_data_path_is_refused(tiny_pair, tmp_path):
    """Issue 64 row 2: ``data.path=[A,A]`` (or another spelling of A, or a copy of A) would count every
    row twice; it is refused naming both entries, before anything is written."""
    vocab = tiny_pair.vocab
    a = save_dataset(tmp_path / "a", {"train": random_rows(6, vocab, 1), "dev": random_rows(4, vocab, 2)},
                     tiny_pair.draft, 32, vocab)
    copy = shutil.copytree(a, tmp_path / "copy")
    for other, why in ((a, "are one directory"), (tmp_path / "x" / ".." / "a", "are one directory"),
                       (copy, "hold the same rows")):
        with pytest.raises(ValueError, match=rf"data.path names the same dataset twice: entries 1 \('{a}'\) and 2 "
                                             rf"\('{re.escape(str(other))}'\) {why}, so every row would count twice"):
            run(train_cfg([*base_overrides(tiny_pair, a, tmp_path), f"data.path=[{a},{other}]"]))
    assert not (tmp_path / "head").exists() and not (tmp_path / "cache").exists()
