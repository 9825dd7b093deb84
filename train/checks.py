"""Checks that run before training: settings, the labelled dataset and its draft model.

Every failure is a ValueError/FileNotFoundError that names the input and what to do.
"""

from __future__ import annotations

import os

import pyarrow.compute as pc

from specdecpp.data.dataset import DatasetError, load_labelled, rows_digest
from specdecpp.models.fit import check_draft_fit


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


# What datasets joined for one training must share (the pair, its sampling, what the labels mean)
JOIN_KEYS = ("draft", "target", "sampling", "vocab_size", "draft_hidden_size", "labels")


def load_dataset_dir(path):
    """Read and validate a data_gen dataset directory (schema, lengths, labels): (DatasetDict, meta).
    A list of directories (``data.path=[A,B]``) is read as one dataset: see :func:`join_datasets`."""
    if path is not None and not isinstance(path, (str, bytes)) and hasattr(path, "__iter__"):
        paths = [str(p) for p in path]
        if not paths:
            raise ValueError("data.path is an empty list: give a data_gen output directory, or a list of them")
        if len(paths) == 1:
            return load_dataset_dir(paths[0])
        check_distinct(paths, [os.path.realpath(os.path.expanduser(p)) for p in paths], "are one directory")
        loaded = [load_dataset_dir(p) for p in paths]
        check_distinct(paths, [rows_digest(splits) for splits, _ in loaded], "hold the same rows")
        return join_datasets(paths, loaded)
    if path is None or str(path) == "":
        raise ValueError("data.path is not set: pass the data_gen output directory, e.g. data.path=data/demo/bundled")
    try:
        return load_labelled(path)
    except DatasetError:
        raise
    except Exception as exc:  # datasets fails with e.g. IndexError on a split saved with no rows
        raise ValueError(f"could not read the dataset in {str(path)!r} ({type(exc).__name__}: {exc}); an empty "
                         "split cannot be read back: regenerate the dataset with python -m data_gen") from exc


def check_distinct(paths: list[str], keys: list[str], same: str) -> None:
    """Refuse a ``data.path`` list that names one dataset twice (two entries with one ``key``: a
    resolved directory, or a :func:`~specdecpp.data.dataset.rows_digest`): its rows would count twice."""
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key in first:
            j = first[key]
            raise ValueError(f"data.path names the same dataset twice: entries {j + 1} ({paths[j]!r}) and {i + 1} "
                             f"({paths[i]!r}) {same}, so every row would count twice in training and evaluation. "
                             "Remove one of them; to train on more labels of the same prompts, join a dataset "
                             "labelled with another data_gen seed")
        first[key] = i


def join_datasets(paths: list[str], loaded: list) -> tuple:
    """Several data_gen outputs of one pair as one dataset: each split the rows of every directory
    that has it, in the order given (e.g. the same prompts labelled again with another data_gen
    ``seed``: new responses and candidates, more positions). The pair, the sampling and the label
    kind must agree (``JOIN_KEYS``), and no prompt id of a ``dev`` or ``test`` row may appear in
    ``train``. The meta is the first directory's, with every source listed under ``joined``."""
    from datasets import DatasetDict, concatenate_datasets

    first = loaded[0][1]
    for path, (_, meta) in zip(paths[1:], loaded[1:], strict=True):
        for key in JOIN_KEYS:
            if meta.get(key) != first.get(key):
                raise ValueError(f"data.path: {path!r} and {paths[0]!r} differ in {key} ({meta.get(key)!r} against "
                                 f"{first.get(key)!r}); datasets trained together must come from one pair, with "
                                 "one sampling and one kind of label")
    names = list(dict.fromkeys(name for splits, _ in loaded for name in splits))
    try:
        joined = DatasetDict({name: concatenate_datasets([splits[name] for splits, _ in loaded if name in splits])
                              for name in names})
    except ValueError as exc:
        raise ValueError(f"data.path: the datasets {paths} do not share one schema ({exc}); regenerate the older "
                         "ones with this version of data_gen") from exc
    if "train" in joined:
        train_ids = set(joined["train"]["id"])
        for name in ("dev", "test"):
            leaked = sorted(train_ids & set(joined[name]["id"])) if name in joined else []
            if leaked:
                raise ValueError(f"data.path: {len(leaked)} prompt(s) of the joined {name!r} split are also in "
                                 f"'train' (e.g. {leaked[0]!r}): join datasets whose splits hold the same prompts")
    sources = [{"path": path, **{k: meta.get(k) for k in ("created", "seed", "dtype", "max_new_tokens", "rows")}}
               for path, (_, meta) in zip(paths, loaded, strict=True)]
    return joined, {**first, "rows": {name: len(joined[name]) for name in names}, "joined": sources}


def arrow_column(split, name: str):
    """One column as a pyarrow ChunkedArray (respects a selection/indices mapping)."""
    return split.with_format("arrow")[name]


def check_split(split, name: str, path: str, vocab_size: int) -> None:
    """What load_labelled leaves to the trainer: rows and response tokens exist, ids fit the draft."""
    where = f"split {name!r} of dataset {path!r}"
    if len(split) == 0:
        raise ValueError(f"{where} is empty: no prompts to train on; regenerate it with more prompts")
    if pc.sum(pc.list_value_length(arrow_column(split, "target_ids"))).as_py() == 0:
        raise ValueError(f"{where} has no response tokens at all (every target_ids is empty)")
    for column in ("prompt_ids", "target_ids", "draft_ids"):
        ids = pc.list_flatten(arrow_column(split, column)).to_numpy(zero_copy_only=False)
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{where}: {column} holds token id "
                             f"{int(ids.max() if ids.max() >= vocab_size else ids.min())} "
                             f"outside the draft's vocabulary [0, {vocab_size}): "
                             "the dataset was made with another tokenizer")


def check_draft_matches(meta: dict, draft_ref: str, hidden_size: int, path: str, allow_mismatch: bool) -> None:
    """The dataset's labels belong to the draft that made them: refuse another draft
    (``specdecpp.models.fit``, the check a head gets in infer), another name for it only unless allowed."""
    check_draft_fit(f"dataset {path!r}", "dataset", meta.get("draft"), meta.get("draft_hidden_size"), draft_ref,
                    hidden_size, "data.allow_draft_mismatch", allow_mismatch)
