"""Draft features for one fixed token mixing, computed once and memory-mapped from disk.

The draft is frozen, so the hidden states e_i at the Y-positions of a fixed mixing never change:
every head of a sweep can train on them without running the draft again. Layout of one cache
(``<cache_dir>/<split>-<key>/``):

- ``features.npy`` [M, H] (float32 or float16), ``labels.npy`` [M] float32: one row per Y-position,
  prompts in dataset order; ``offsets.npy`` [rows + 1] int64: prompt j owns rows offsets[j]:offsets[j+1].
- ``cache.json``: what the key was made of, and ``complete``; ``progress.json``: rows done so far.

The key hashes the split's fingerprint, the draft's identity (:func:`draft_identity`, read from
its files: no weights are loaded) and the precision it computes in, the mixing ratio and seed and
the storage dtype, so a change to
any of them builds a new cache, and a cache hit never loads the draft (a 20-head sweep loads it
once, to build the cache). An interrupted build resumes at the last finished chunk; a job that
finds another building the same cache (a parallel sweep launcher, the other DDP ranks) waits for
it (``build.lock``, POSIX file locking).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from specdecpp.models.identity import model_identity
from specdecpp.models.loading import load_config
from specdecpp.training.mixing import (
    FIXED_MIXING_EPOCH,
    check_context,
    feature_label_positions,
    loss_positions,
    mixed_features,
)

from .checks import arrow_column

FORMAT_VERSION = 2  # 2: keyed by draft_identity (1: by a fingerprint of the loaded weights)
DTYPES = {"float32": np.float32, "float16": np.float16}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model")


def draft_identity(ref: str) -> str:
    """What names a draft's weights, from its files alone (no load): a materialised demo draft's
    artifact digest; for a local directory or .gguf file, its resolved path with the name, size and
    modification time of every weight and config file (retrained or replaced weights change it;
    a copy elsewhere builds its own cache); for a hub id, the id and the cached snapshot's commit."""
    identity = model_identity(ref)
    if identity is not None:
        return identity
    path = Path(os.path.expanduser(str(ref)))
    if path.exists():
        files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES) if path.is_dir() else [path]
        stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        digest = hashlib.sha256(json.dumps([str(path.resolve()), stats]).encode()).hexdigest()[:16]
        return f"{path.resolve()}@{digest}"
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(ref), "config.json")
    except Exception:  # not a valid repo id: the ref alone (loading it will say what is wrong)
        cached = None
    return f"{ref}@{Path(cached).parent.name}" if isinstance(cached, str) else str(ref)


class FeatureCache:
    """Read side: ``cache.row(j) -> (hidden [n_j, H], labels [n_j])`` from the memory maps."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.info = json.loads((self.directory / "cache.json").read_text())
        self.features = np.load(self.directory / "features.npy", mmap_mode="r")
        self.labels = np.load(self.directory / "labels.npy", mmap_mode="r")
        self.offsets = np.load(self.directory / "offsets.npy")

    def __getstate__(self) -> dict:  # worker processes reopen the memory maps instead of copying them
        return {"directory": self.directory}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        return torch.from_numpy(np.array(self.features[a:b])), torch.from_numpy(np.array(self.labels[a:b]))


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def feature_cache(split, split_name: str, draft, draft_ref: str, cache_dir: str | os.PathLike,
                  mix_ratio: float, mix_seed: int, dtype: str = "float32", batch_size: int = 8,
                  spec: dict | None = None, feature_size: int | None = None,
                  draft_precision: str = "float32", target=None) -> FeatureCache:
    """Open the cache for this (split, draft, mixing, head features), building or finishing it
    first if needed. ``draft`` is the loaded draft or a function that loads it: called only to
    build. ``spec``/``feature_size``: the head's :meth:`feature_spec` and feature size (None: the
    paper's head, the draft's hidden states). ``draft_precision``: the dtype the draft computes in
    (features of a bf16 draft differ from a float32 one's, so they key another cache). ``target``:
    a feature draft's target (or a function that loads it), which its features need; called only to build."""
    if dtype not in DTYPES:
        raise ValueError(f"data.cache_dtype must be one of {list(DTYPES)}, got {dtype!r}")
    loaded = hasattr(draft, "config")
    config = draft.config if loaded else load_config(draft_ref)
    info = {"format": FORMAT_VERSION, "split": split_name, "split_fingerprint": split._fingerprint,
            "rows": len(split), "draft": draft_identity(draft_ref),
            "hidden_size": int(config.hidden_size), "mix_ratio": float(mix_ratio),
            "mix_seed": int(mix_seed), "dtype": dtype}
    # the paper's head keeps its old keys, but for a feature draft (its features come from the target too)
    if spec is not None and (spec.get("kind", "resnet") != "resnet" or target is not None):
        info.update(features=spec, feature_size=int(feature_size))
    if draft_precision != "float32":  # float32 caches keep their old keys
        info["draft_precision"] = draft_precision
    key = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    directory = Path(cache_dir) / f"{split_name}-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a parallel sweep job building this cache: wait for it
        state_file = directory / "cache.json"
        if not (state_file.is_file() and json.loads(state_file.read_text()).get("complete")):
            _build(split, split_name, draft if loaded else draft(), directory, {**info, "key": key}, batch_size,
                   target() if callable(target) else target)
    return FeatureCache(directory)


def _build(split, split_name: str, draft, directory: Path, info: dict, batch_size: int, target=None) -> None:
    """Write the features chunk by chunk, recording progress; continue a build that was cut off."""
    mix_ratio, mix_seed = info["mix_ratio"], info["mix_seed"]
    state_file, progress_file = directory / "cache.json", directory / "progress.json"
    n_tokens = pc.list_value_length(arrow_column(split, "target_ids")).to_numpy(zero_copy_only=False)
    by_depth = "depth_p_acc" in split.column_names  # a feature draft's labels: a row per (position, depth)
    context = check_context(info.get("features"), feature_draft=by_depth)
    kept = ([feature_label_positions(r) for r in split["depth_p_acc"]] if by_depth else
            [loss_positions(int(n), mix_ratio, mix_seed, FIXED_MIXING_EPOCH, j, context)
             for j, n in enumerate(n_tokens)])
    offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    shape = (int(offsets[-1]), int(info.get("feature_size", draft.config.hidden_size)))
    resume = state_file.is_file() and progress_file.is_file()
    done = json.loads(progress_file.read_text())["rows_done"] if resume else 0
    mode = "r+" if resume else "w+"
    features = np.lib.format.open_memmap(directory / "features.npy", mode=mode, dtype=DTYPES[info["dtype"]],
                                         shape=shape)
    labels = np.lib.format.open_memmap(directory / "labels.npy", mode=mode, dtype=np.float32, shape=shape[:1])
    if not resume:
        np.save(directory / "offsets.npy", offsets)
        _write_json(state_file, {**info, "positions": shape[0], "complete": False})
        _write_json(progress_file, {"rows_done": 0})

    columns = ["prompt_ids", "target_ids", "draft_ids", "p_acc"] + (["depth_draft_ids", "depth_p_acc"] * by_depth)
    rows = split.select_columns(columns).with_format("torch")
    with tqdm(total=len(split), initial=done, desc=f"draft features ({split_name})", unit="prompt") as bar:
        for start in range(done, len(split), batch_size):
            stop = min(start + batch_size, len(split))
            chunk = [{**rows[j], "row": j} for j in range(start, stop)]
            hidden, chunk_labels = mixed_features(draft, chunk, mix_ratio, mix_seed, FIXED_MIXING_EPOCH,
                                                  info.get("features"),
                                                  **({"target": target} if target is not None else {}))
            a, b = int(offsets[start]), int(offsets[stop])
            if b > a:
                features[a:b] = torch.cat(hidden).float().cpu().numpy()
                labels[a:b] = torch.cat(chunk_labels).numpy()
            features.flush()
            labels.flush()
            _write_json(progress_file, {"rows_done": stop})
            bar.update(stop - start)
    del features, labels
    _write_json(state_file, {**info, "positions": shape[0], "complete": True})
