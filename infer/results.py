"""Result files: one JSONL row per prompt, appended and flushed as each prompt finishes, so an
interrupted run resumes where it stopped without redoing or duplicating prompts."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from specdecpp.data.prompts import prompt_digest
from specdecpp.models.identity import same_model

log = logging.getLogger(__name__)

# Keys that must agree between a run and the rows already in its result file.
RUN_KEYS = ("method", "settings", "pair", "prompts", "sampling", "seed", "max_new_tokens", "batch_size", "fast",
            "capture_rounds")
# what a row written before the key existed means
RUN_DEFAULTS = {"batch_size": 1, "fast": None, "capture_rounds": True}


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The seed for one prompt: the same (seed, prompt id) gives the same seed in every method."""
    digest = hashlib.sha256(f"{int(seed)}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def read_rows(path: Path) -> list[dict]:
    """Rows of a result file. A cut last line (a run killed mid-write) is ignored; any other
    unreadable line is an error naming the file and line. The file is not modified."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:  # no newline after it: the write was interrupted
                break
            raise ValueError(f"result file {path} line {i + 1} is not valid JSON ({exc}); "
                             "fix or delete that file") from exc
    return rows


def repair_tail(path: Path) -> None:
    """Make the file end with a complete line before appending: drop a cut last line, or add the
    newline a complete last row is missing."""
    path = Path(path)
    if not path.exists():
        return
    text = path.read_text()
    if not text or text.endswith("\n"):
        return
    head, _, last = text.rpartition("\n")
    try:
        json.loads(last)
        path.write_text(text + "\n")
    except json.JSONDecodeError:
        path.write_text(head + "\n" if head else "")


def same_run_value(key: str, written, now) -> bool:
    """Whether a row's setting ``key`` equals this run's. A pair's models may be named another way
    (:func:`~specdecpp.models.identity.same_model`: a relative or absolute path to one local directory,
    as two spellings of ``SPECDECPP_CACHE`` give, or its portable identity); everything else as it is."""
    if written == now:
        return True
    if key != "pair" or not (isinstance(written, dict) and isinstance(now, dict)) or written.keys() != now.keys():
        return False
    models = ("draft", "target")
    return all(written[k] == now[k] for k in written if k not in models) and all(
        isinstance(written.get(k), str) and isinstance(now.get(k), str) and same_model(written[k], now[k])
        for k in models if k in written)


def check_resumable(path: Path, rows: list[dict], run: dict) -> None:
    """Refuse to append to a file written with other settings (it would mix two experiments)."""
    for row in rows:
        diff = [k for k in RUN_KEYS
                if not same_run_value(k, row.get(k, RUN_DEFAULTS.get(k)), run.get(k, RUN_DEFAULTS.get(k)))]
        if diff:
            k = diff[0]
            raise ValueError(
                f"result file {path} holds rows with different {', '.join(diff)} "
                f"(file: {row.get(k)!r}, this run: {run.get(k)!r}); choose another out= directory "
                f"or pair.name, or move that file away; it was left untouched")


def check_same_prompts(path: Path, rows: list[dict], prompts) -> None:
    """Refuse to resume a result file whose rows were decoded from other prompt texts than this run
    gives the same ids (rows record ``prompt_digest``, :func:`specdecpp.data.prompts.prompt_digest`).
    Rows written before the digest was recorded are trusted, with one warning."""
    now = {q.id: prompt_digest(q) for q in prompts}
    unchecked = 0
    for row in rows:
        pid, written = row.get("prompt_id"), row.get("prompt_digest")
        if pid not in now:
            continue
        if written is None:
            unchecked += 1
        elif written != now[pid]:
            raise ValueError(f"result file {path} holds a row for prompt {pid!r} decoded from another text: its digest "
                             f"there is {written}, the prompts now give {now[pid]} (the prompts changed since that row "
                             "was written). Restore the original prompts to resume, or start a fresh result file: "
                             "choose another out= directory or move that file away; it was left untouched")
    if unchecked:
        log.warning("%s: %d row(s) were written before prompt digests were recorded; trusting that their prompts "
                    "are unchanged (move the file away to decode them again)", path, unchecked)


def pooled_wall(rows: list[dict]) -> float:
    """The wall time of timed rows: one prompt's each, or for batched rows each call's once."""
    calls = {r["batch_id"]: r["batch_wall_time_s"] for r in rows if r.get("batch_id") is not None}
    return sum(r["wall_time_s"] for r in rows if r.get("batch_id") is None) + sum(calls.values())


class ResultWriter:
    """Appends rows to a JSONL file, each one flushed and synced to disk before the next prompt."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(self.path)

    def append(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())


# What a row needs to be counted in a table (infer.summary reads these keys of every row).
ROW_KEYS = ("method", "settings", "pair", "prompts", "sampling", "n_generated", "n_draft", "n_target",
            "n_discarded", "accept_lengths")


def parse_line(line: str, last: bool) -> tuple[dict | None, str | None]:
    """One line of a result file: ``(row, None)``, or ``(None, why)`` where it is no row the report can count."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, ("cut short (the file's last line, with no newline: a run stopped mid-write; `python -m infer` "
                      "with the same settings redoes that prompt)" if last else f"not valid JSON ({exc})")
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not a result row"
    missing = [k for k in ROW_KEYS if k not in row]
    return (None, f"a result row without {', '.join(missing)}") if missing else (row, None)


def read_result_dir(root: str | Path, skipped: list[dict] | None = None) -> list[dict]:
    """Every row of every ``*.jsonl`` file under ``root`` (recursively; or that one file), with
    ``_file`` added. Strict by default (:func:`read_rows`: what ``python -m infer`` resumes from);
    given a ``skipped`` list (the report), a cut or malformed line is left out and recorded there as
    ``{"file", "line", "problem"}`` (:func:`parse_line`)."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"results directory {str(root)!r} does not exist; run `python -m infer` first")
    files = [root] if root.is_file() else sorted(root.rglob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no *.jsonl result files under {str(root)!r}")
    rows = []
    for f in files:
        if skipped is None:
            rows += [{**row, "_file": str(f)} for row in read_rows(f)]
            continue
        lines = f.read_text().split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            row, problem = parse_line(line, last=i == len(lines) - 1)
            if problem:
                skipped.append({"file": str(f), "line": i + 1, "problem": problem})
            else:
                rows.append({**row, "_file": str(f)})
    return rows
