"""Sequoia's acceptance vector file: ``python -m infer.sequoia measure`` writes it, ``infer.sequoia
tree`` and ``method=sequoia`` (the DP's tree, ``method.acceptance``) read it."""

from __future__ import annotations

import json
from pathlib import Path

from specdecpp.analysis.tree_search import check_acceptance

SCHEMA = "specdecpp.acceptance/1"


def load_acceptance(path: str | Path) -> dict:
    """The file's JSON, its ``acceptance`` vector checked; FileNotFoundError or ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"acceptance file {str(path)!r} not found (python -m infer.sequoia measure --out FILE)")
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA!r}")
        check_acceptance(data["acceptance"])
    except (ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"acceptance file {str(path)!r}: {exc}") from None
    return data
