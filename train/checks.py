"""Checks that run before training: settings, the labelled dataset and its draft model.

Every failure is a ValueError/FileNotFoundError that names the input and what to do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

COLUMNS = ("id", "prompt", "prompt_ids", "target_ids", "draft_ids", "p_acc", "draft_entropy")
META_FILE = "specdecpp_meta.json"


def check_settings(w_rej: float, w_acc: float, mix_ratio: float, mix_seed: int, depth: int,
                   batch_size: int, cache_features: bool, remix_each_epoch: bool) -> None:
    if not w_rej > 0:
        raise ValueError(f"loss.w_rej must be > 0 (the weight of rejected candidates), got {w_rej!r}; "
                         "the paper sweeps 1, 3, 6, 12")
    if not w_acc > 0:
        raise ValueError(f"loss.w_acc must be > 0, got {w_acc!r}; the paper uses 1")
    if not 0.0 <= mix_ratio < 1.0:
        raise ValueError(f"data.mix_ratio must be in [0, 1) (fraction of target tokens in Z), got {mix_ratio!r}")
    if not (isinstance(mix_seed, int) and mix_seed >= 0):
        raise ValueError(f"data.mix_seed must be an integer >= 0, got {mix_seed!r}")
    if not (isinstance(depth, int) and depth >= 0):
        raise ValueError(f"head.depth must be an integer >= 0, got {depth!r}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"data.batch_size must be an integer >= 1, got {batch_size!r}")
    if cache_features and remix_each_epoch:
        raise ValueError("data.cache_features=true caches ONE fixed mixing, data.remix_each_epoch=true draws "
                         "a new one each epoch: set one of them to false")


def load_dataset_dir(path: str | os.PathLike):
    """Read a data_gen dataset directory: (DatasetDict, meta dict)."""
    from datasets import DatasetDict, load_from_disk

    if path is None or str(path) in ("", "???"):
        raise ValueError("data.path is not set: pass the data_gen output directory, e.g. data.path=data/demo/alpaca")
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"dataset directory {str(path)!r} does not exist: run `python -m data_gen` "
                                "first or fix data.path")
    meta_file = directory / META_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} is missing: {str(path)!r} is not a data_gen dataset directory")
    try:
        splits = load_from_disk(str(directory))
    except Exception as exc:
        raise ValueError(f"could not read the dataset in {str(path)!r} with datasets.load_from_disk "
                         f"({type(exc).__name__}: {exc}); an empty split cannot be read back: regenerate "
                         "the dataset with python -m data_gen") from exc
    if not isinstance(splits, DatasetDict):
        raise ValueError(f"{str(path)!r} holds a single Dataset; data_gen writes a DatasetDict with splits train/dev/test")
    return splits, json.loads(meta_file.read_text())


def arrow_column(split, name: str):
    """One column as a pyarrow ChunkedArray (respects a selection/indices mapping)."""
    return split.with_format("arrow")[name]


def check_split(split, name: str, path: str, vocab_size: int) -> None:
    """Columns present, one label per response token, labels finite and in [0, 1], ids in vocab."""
    where = f"split {name!r} of dataset {path!r}"
    missing = [c for c in COLUMNS if c not in split.column_names]
    if missing:
        raise ValueError(f"{where} lacks columns {missing}; expected {list(COLUMNS)} (regenerate with python -m data_gen)")
    if len(split) == 0:
        raise ValueError(f"{where} is empty: no prompts to train on; regenerate it with more prompts")
    lengths = {c: pc.list_value_length(arrow_column(split, c)).to_numpy(zero_copy_only=False)
               for c in ("target_ids", "draft_ids", "p_acc")}
    bad = np.nonzero((lengths["target_ids"] != lengths["draft_ids"]) | (lengths["target_ids"] != lengths["p_acc"]))[0]
    if len(bad):
        raise ValueError(f"{where}: row {int(bad[0])} has target_ids/draft_ids/p_acc of different lengths "
                         f"({', '.join(str(int(lengths[c][bad[0]])) for c in lengths)})")
    if lengths["p_acc"].sum() == 0:
        raise ValueError(f"{where} has no response tokens at all (every target_ids is empty)")
    p = pc.list_flatten(arrow_column(split, "p_acc")).to_numpy(zero_copy_only=False).astype(np.float64)
    bad = np.nonzero(~np.isfinite(p) | (p < 0) | (p > 1))[0]
    if len(bad):
        raise ValueError(f"{where}: p_acc holds {len(bad)} labels that are NaN or outside [0, 1] "
                         f"(first: {p[bad[0]]!r}); labels are min(1, p/q): regenerate the dataset")
    for column in ("prompt_ids", "target_ids", "draft_ids"):
        ids = pc.list_flatten(arrow_column(split, column)).to_numpy(zero_copy_only=False)
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{where}: {column} holds token id {int(ids.max() if ids.max() >= vocab_size else ids.min())} "
                             f"outside the draft's vocabulary [0, {vocab_size}): the dataset was made with another tokenizer")


def _same_model_ref(a: str, b: str) -> bool:
    pa, pb = Path(os.path.expanduser(str(a))), Path(os.path.expanduser(str(b)))
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return str(a) == str(b)


def check_draft_matches(meta: dict, draft_ref: str, hidden_size: int, path: str, allow_mismatch: bool) -> None:
    """The dataset's labels belong to the draft that made them: refuse another draft unless allowed."""
    made_with, made_hidden = meta.get("draft"), meta.get("draft_hidden_size")
    problems = []
    if made_with is not None and not _same_model_ref(made_with, draft_ref):
        problems.append(f"it was made with draft {made_with!r} but pair.draft is {draft_ref!r}")
    if made_hidden is not None and int(made_hidden) != hidden_size:
        problems.append(f"its draft had hidden size {made_hidden} but pair.draft has {hidden_size}")
    if problems and not allow_mismatch:
        raise ValueError(f"dataset {path!r} does not match the configured draft: {'; '.join(problems)}. "
                         "Labels min(1, p/q) depend on the draft: train with the same draft (pair=...), or set "
                         "data.allow_draft_mismatch=true if it is the same model under another name")
