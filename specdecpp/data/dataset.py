"""The labelled dataset on disk: schema, shard storage while data_gen runs, and a validating loader.

Layout of a dataset directory DIR::

    DIR/specdecpp_meta.json          settings that produced the data; "complete": true once finished
    DIR/dataset_dict.json, DIR/<split>/   the finished DatasetDict (``datasets.load_from_disk``)
    DIR/shards/<split>/<00000>/           shards while data_gen runs (removed once consolidated)
    DIR/shards/<split>/<00000>.done       written after its shard is fully saved (its prompts' digests)
    DIR/prompt_digests.json          every prompt's [id, digest] per split, for a rerun's check

A shard counts as done only once its ``.done`` marker exists, so an interrupted run redoes at most
the shards it was writing. The meta file's ``complete`` flag is written last: a directory
without it is a run that did not finish.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from datasets import (
    Dataset,
    DatasetDict,
    Features,
    Sequence,
    Value,
    concatenate_datasets,
    load_from_disk,
)

FEATURES = Features({
    "id": Value("string"),
    "prompt": Value("string"),
    "prompt_ids": Sequence(Value("int32")),
    "target_ids": Sequence(Value("int32")),
    "draft_ids": Sequence(Value("int32")),
    "p_acc": Sequence(Value("float32")),
    "draft_entropy": Sequence(Value("float32")),
})
# a feature draft's labels at depths 1..D of a round (specdecpp.data.labels.TokenLabels): [N][D] per row,
# column 0 = the plain columns; NaN / -1 where the prompt is too short for that depth
DEPTH_FEATURES = Features({**FEATURES, "depth_draft_ids": Sequence(Sequence(Value("int32"))),
                           "depth_p_acc": Sequence(Sequence(Value("float32"))),
                           "depth_draft_entropy": Sequence(Sequence(Value("float32")))})
DEPTH_COLUMNS = ("depth_draft_ids", "depth_p_acc", "depth_draft_entropy")
TOKEN_COLUMNS = ("target_ids", "draft_ids", "p_acc", "draft_entropy")  # one entry per response token
META_FILE = "specdecpp_meta.json"
SHARDS_DIR = "shards"
PROMPTS_FILE = "prompt_digests.json"  # every split's prompts as [id, digest] pairs, written on consolidation
RESUME_HINT = "data_gen did not finish: rerun the same command to resume"


class DatasetError(ValueError):
    """A labelled dataset directory that is missing, partial or malformed."""


def rows_to_dataset(rows: list[dict]) -> Dataset:
    """Rows (dicts with the FEATURES columns, or DEPTH_FEATURES' for a feature draft) to a Dataset
    with exactly that schema."""
    return Dataset.from_list(rows, features=DEPTH_FEATURES if rows and DEPTH_COLUMNS[0] in rows[0] else FEATURES)


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_meta(directory: str | os.PathLike, meta: dict) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    _write_json_atomic(Path(directory) / META_FILE, meta)


def read_meta(directory: str | os.PathLike) -> dict | None:
    """The meta dict, or None if the directory has none yet."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not valid JSON ({exc}); delete the directory and rerun data_gen") from exc


def shard_path(directory: str | os.PathLike, split: str, index: int) -> Path:
    return Path(directory) / SHARDS_DIR / split / f"{index:05d}"


def shard_done(directory: str | os.PathLike, split: str, index: int) -> bool:
    return shard_path(directory, split, index).with_suffix(".done").is_file()


def save_shard(directory: str | os.PathLike, split: str, index: int, rows: list[dict],
               prompts: list[list[str]] | None = None, skipped: dict[str, int] | None = None) -> None:
    """Save one shard, then its ``.done`` marker; a half-written shard from a crash is replaced.
    The marker records the shard's prompts as ``[id, digest]`` pairs (``prompt_digest``; those
    ``skipped`` too, which have no row) so that a resumed run can check it labels the same prompts."""
    final = shard_path(directory, split, index)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    for stale in (final, tmp):
        shutil.rmtree(stale, ignore_errors=True)
    if rows:  # every prompt skipped: the marker alone (`datasets` cannot read back a Dataset without rows)
        rows_to_dataset(rows).save_to_disk(str(tmp))
        os.replace(tmp, final)
    marker = {"rows": len(rows), "ids": [r["id"] for r in rows],
              "prompts": prompts if prompts is not None else _row_digests(rows)}
    if skipped:
        marker["skipped"] = dict(skipped)
    _write_json_atomic(final.with_suffix(".done"), marker)


def _row_digests(rows) -> list[list[str]]:
    """``[id, digest]`` of each row's prompt (the text a row stores is the text it was labelled from)."""
    from .prompts import Prompt, prompt_digest

    return [[r["id"], prompt_digest(Prompt(r["id"], r["prompt"]))] for r in rows]


def _marker(directory, split: str, index: int) -> dict:
    return json.loads(shard_path(directory, split, index).with_suffix(".done").read_text())


def shard_prompts(directory: str | os.PathLike, split: str, index: int) -> tuple[list[list[str]], dict[str, int]]:
    """A done shard's prompts as ``[id, digest]`` pairs, and those it skipped (id -> tokens). A
    marker written before digests were recorded: the digests of the rows' own prompt texts."""
    marker = _marker(directory, split, index)
    if "prompts" in marker:
        return marker["prompts"], marker.get("skipped", {})
    shard = load_from_disk(str(shard_path(directory, split, index))).select_columns(["id", "prompt"])
    return _row_digests(shard), {}


def recorded_prompts(directory: str | os.PathLike) -> dict[str, list[list[str]]]:
    """A complete dataset's prompts per split as ``[id, digest]`` pairs (:data:`PROMPTS_FILE`, in
    the order they were planned, skipped ones included); for a dataset made before that file was
    written, the digests of its rows' prompt texts."""
    directory = Path(directory)
    if (directory / PROMPTS_FILE).is_file():
        return json.loads((directory / PROMPTS_FILE).read_text())["splits"]
    splits = load_from_disk(str(directory))
    return {name: _row_digests(ds.select_columns(["id", "prompt"])) for name, ds in splits.items()}


def unreadable_arrow_file(split_dir: str | os.PathLike) -> tuple[Path, str] | None:
    """The first Arrow file of a saved split (``state.json``'s data files) that cannot be read to
    the end, with the reason; None if all read. Memory-mapped, so reading costs no copy."""
    import pyarrow as pa

    split_dir = Path(split_dir)
    try:
        files = [f["filename"] for f in json.loads((split_dir / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return split_dir / "state.json", f"{type(exc).__name__}: {exc}"
    for name in files:
        try:
            with pa.memory_map(str(split_dir / name)) as source:
                pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowException) as exc:
            return split_dir / name, f"{type(exc).__name__}: {exc}"
    return None


def consolidate(directory: str | os.PathLike, shard_counts: dict[str, int], meta: dict) -> DatasetDict:
    """Join every split's shards into the final DatasetDict, mark the meta complete, drop shards."""
    directory = Path(directory)
    missing = [f"{s}/{i:05d}" for s, n in shard_counts.items() for i in range(n) if not shard_done(directory, s, i)]
    if missing:
        raise DatasetError(f"{directory}: {len(missing)} shard(s) not finished ({', '.join(missing[:5])}); "
                           "run the remaining shard processes (or the same command) first")
    filled = {split: [i for i in range(n) if _marker(directory, split, i).get("rows", 1)]
              for split, n in shard_counts.items()}
    for split, indices in filled.items():
        for i in indices:
            damaged = unreadable_arrow_file(shard_path(directory, split, i))
            if damaged:
                shard = shard_path(directory, split, i)
                raise DatasetError(f"{directory}: shard {split}/{i:05d} is damaged ({damaged[0]} cannot be read: "
                                   f"{damaged[1]}). Regenerate that shard: delete {shard} and "
                                   f"{shard.with_suffix('.done')}, then rerun the same data_gen command (it "
                                   "resumes and relabels only the missing shard)")
    def parts(split: str, indices: list[int]) -> list[Dataset]:
        loaded = [load_from_disk(str(shard_path(directory, split, i))) for i in indices]
        return [d for d in loaded if len(d)] or loaded[:1]  # an empty shard has the plain schema

    joined = {split: concatenate_datasets(parts(split, indices)) for split, indices in filled.items() if indices}
    # a split without rows is left out: `datasets` cannot save and reload an empty split
    splits = DatasetDict({split: ds for split, ds in joined.items() if len(ds)})
    if not splits:
        raise DatasetError(f"{directory}: no prompt produced a row; check the prompt source and limits")
    splits.save_to_disk(str(directory))
    prompts, skipped = {}, {}
    for split, n in shard_counts.items():
        for i in range(n):
            written, skips = shard_prompts(directory, split, i)
            prompts.setdefault(split, []).extend(written)
            skipped.update(skips)
    _write_json_atomic(directory / PROMPTS_FILE, {"splits": prompts})
    rows = {split: len(joined[split]) if split in joined else 0 for split in shard_counts}
    write_meta(directory, {**meta, "complete": True, "rows": rows, **({"skipped_prompts": skipped} if skipped else {})})
    shutil.rmtree(directory / SHARDS_DIR, ignore_errors=True)
    return load_from_disk(str(directory))


def _fail(path: Path, what: str) -> DatasetError:
    return DatasetError(f"labelled dataset {str(path)!r}: {what}")


def _check_split(path: Path, split: str, ds: Dataset) -> None:
    import pyarrow.compute as pc

    schema = DEPTH_FEATURES if DEPTH_COLUMNS[0] in ds.column_names else FEATURES
    if set(ds.column_names) != set(schema):
        missing, extra = sorted(set(schema) - set(ds.column_names)), sorted(set(ds.column_names) - set(schema))
        raise _fail(path, f"split {split!r} has the wrong columns (missing {missing}, unexpected {extra}); "
                          "it was not written by data_gen")
    for name, feature in schema.items():
        if ds.features[name] != feature:
            raise _fail(path, f"split {split!r} column {name!r} has type {ds.features[name]}, expected {feature}")
    if len(ds) == 0:
        return
    table = ds.with_format("arrow")[:]  # respects a selection / indices mapping
    columns = TOKEN_COLUMNS + (DEPTH_COLUMNS if schema is DEPTH_FEATURES else ())
    lengths = {c: pc.list_value_length(table.column(c)) for c in columns}
    for c in columns[1:]:
        unequal = pc.not_equal(lengths[c], lengths["target_ids"])
        if pc.any(unequal).as_py():
            row = pc.index(unequal, True).as_py()
            raise _fail(path, f"split {split!r} row {row} (id {ds[row]['id']!r}): {c} has "
                              f"{lengths[c][row].as_py()} entries but target_ids has "
                              f"{lengths['target_ids'][row].as_py()}")
    p_acc = pc.list_flatten(table.column("p_acc"))
    if len(p_acc):
        lo, hi = pc.min(p_acc).as_py(), pc.max(p_acc).as_py()
        if pc.any(pc.is_nan(p_acc)).as_py() or not (math.isfinite(lo) and math.isfinite(hi)):
            raise _fail(path, f"split {split!r}: p_acc has non-finite values")
        if lo < 0 or hi > 1:
            raise _fail(path, f"split {split!r}: p_acc must lie in [0, 1], found range [{lo}, {hi}]")
    if schema is DEPTH_FEATURES:
        deep = pc.list_flatten(pc.list_flatten(table.column("depth_p_acc")))
        deep = pc.drop_null(pc.if_else(pc.is_nan(deep), None, deep)) if len(deep) else deep
        if len(deep) and (pc.min(deep).as_py() < 0 or pc.max(deep).as_py() > 1):
            raise _fail(path, f"split {split!r}: depth_p_acc must lie in [0, 1] (or NaN where no round reaches "
                              f"that depth), found range [{pc.min(deep).as_py()}, {pc.max(deep).as_py()}]")


def load_labelled(path: str | os.PathLike) -> tuple[DatasetDict, dict]:
    """Load a finished data_gen output as ``(DatasetDict, meta)``, checking schema and labels."""
    path = Path(path)
    if not path.is_dir():
        raise _fail(path, "directory not found; run data_gen first (python -m data_gen ... out=DIR)")
    meta = read_meta(path)
    if meta is None:
        raise _fail(path, f"no {META_FILE}; this is not a data_gen output directory")
    if not meta.get("complete"):
        raise _fail(path, RESUME_HINT)
    for split_dir in sorted(p.parent for p in path.glob("*/state.json")):
        damaged = unreadable_arrow_file(split_dir)
        if damaged:
            raise _fail(path, f"the dataset is damaged: {damaged[0]} (split {split_dir.name!r}) cannot be read "
                              f"({damaged[1]}). Regenerate it: move {str(path)!r} away (or delete it) and rerun the "
                              f"data_gen command that made it with out={path} (its settings are in {META_FILE}; the "
                              "same seed gives the same rows, and an interrupted run resumes shard by shard)")
    try:
        splits = load_from_disk(str(path))
    except IndexError as exc:  # what `datasets` raises for a split saved with no rows
        raise _fail(path, "a split has no rows and cannot be read back; regenerate it with more prompts") from exc
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise _fail(path, f"the data files are missing or corrupt ({exc}); "
                          "delete the directory and rerun data_gen") from exc
    if not isinstance(splits, DatasetDict):
        raise _fail(path, "holds a single Dataset, expected a DatasetDict of splits")
    for split, ds in splits.items():
        _check_split(path, split, ds)
    return splits, meta


def dataset_fingerprint(splits: DatasetDict, meta: dict) -> str:
    """A short hash that names the data: the meta (settings, creation time) and each split's rows
    and ``datasets`` fingerprint (saved with the data, new whenever it is rewritten)."""
    import hashlib

    parts = {"meta": meta, "splits": {name: [len(ds), ds._fingerprint] for name, ds in sorted(splits.items())}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rows_digest(splits: DatasetDict) -> str:
    """A SHA-256 of the rows themselves (per split: ids, responses, candidates and labels), so that
    two directories holding the same labelled data (a copy, or the same data_gen run made twice)
    have one digest wherever they lie and whenever they were written."""
    import hashlib

    import pyarrow.compute as pc

    digest = hashlib.sha256()
    for name, ds in sorted(splits.items()):
        table = ds.with_format("arrow")[:]
        digest.update(json.dumps([name, table.column("id").to_pylist()]).encode())
        for column in ("target_ids", "draft_ids", "p_acc"):
            digest.update(pc.list_value_length(table.column(column)).to_numpy(zero_copy_only=False).tobytes())
            digest.update(pc.list_flatten(table.column(column)).to_numpy(zero_copy_only=False).tobytes())
    return digest.hexdigest()


def label_summary(splits: DatasetDict) -> dict[str, dict]:
    """Per split: rows, labelled tokens, mean response length, mean p_acc (the draft's expected
    acceptance rate on target text), shares of p_acc == 1 and == 0, mean draft entropy."""
    import pyarrow.compute as pc

    summary = {}
    for name, ds in splits.items():
        table = ds.with_format("arrow")[:]
        p_acc, entropy = pc.list_flatten(table["p_acc"]), pc.list_flatten(table["draft_entropy"])
        n = len(p_acc)
        summary[name] = {
            "rows": len(ds), "tokens": n, "mean_length": n / max(len(ds), 1),
            "mean_p_acc": pc.mean(p_acc).as_py() if n else float("nan"),
            "share_p_acc_1": pc.sum(pc.equal(p_acc, 1.0)).as_py() / n if n else float("nan"),
            "share_p_acc_0": pc.sum(pc.equal(p_acc, 0.0)).as_py() / n if n else float("nan"),
            "mean_draft_entropy": pc.mean(entropy).as_py() if n else float("nan"),
        }
    return summary
