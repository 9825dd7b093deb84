"""Reading the project's small JSON files (costs.json, token-tree files) with errors that name the
file, what it is and how to make one."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(path: str | Path, what: str, hint: str):
    """The parsed content of ``path``. A missing file raises FileNotFoundError, invalid JSON a
    ValueError, both naming ``what`` (e.g. "costs file") and the path; ``hint`` says how to make one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} not found ({hint})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {str(path)!r}: not valid JSON ({exc})") from None
