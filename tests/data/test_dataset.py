"""specdecpp.data.dataset: a labelled dataset is checked on load (bad labels, missing or unfinished
data named), and consolidation leaves out a split without rows."""

from __future__ import annotations

import json
import shutil

import pytest

from specdecpp.data.dataset import (
    FEATURES,
    DatasetError,
    load_labelled,
    rows_to_dataset,
    write_meta,
)


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


def test_a_shard_whose_prompts_were_all_skipped_is_a_marker_alone(tmp_path):
    """long_prompts=skip can leave a shard without rows: its marker records the prompts and the
    skipped ones, consolidation joins the other shards and records the skipped prompts."""
    from specdecpp.data.dataset import (
        PROMPTS_FILE,
        consolidate,
        save_shard,
        shard_done,
        shard_prompts,
    )

    row = {"id": "a", "prompt": "hi", "prompt_ids": [1, 2], "target_ids": [3, 4], "draft_ids": [3, 5],
           "p_acc": [1.0, 0.25], "draft_entropy": [0.5, 0.7]}
    save_shard(tmp_path, "train", 0, [row])
    save_shard(tmp_path, "train", 1, [], prompts=[["long", "0123abcd"]], skipped={"long": 9000})
    assert shard_done(tmp_path, "train", 1) and shard_prompts(tmp_path, "train", 1) == ([["long", "0123abcd"]],
                                                                                      {"long": 9000})
    consolidate(tmp_path, {"train": 2}, {"draft": "d"})
    splits, meta = load_labelled(tmp_path)
    assert splits["train"]["id"] == ["a"] and meta["skipped_prompts"] == {"long": 9000}
    assert [pid for pid, _ in json.loads((tmp_path / PROMPTS_FILE).read_text())["splits"]["train"]] == ["a", "long"]
