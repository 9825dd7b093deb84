"""Saved heads broken on purpose (issue 64 rows 5-7): a config.json key missing or of the wrong
type, a model.safetensors cut in half."""

from __future__ import annotations

import json
from pathlib import Path

from specdecpp.stopping.head import CONFIG_NAME, WEIGHTS_NAME, build_head

DROP = object()  # a value that removes the key


def broken_head(directory: Path, size: int, of_kind: str = "resnet", draft: str | None = None,
                cut: bool = False, **config) -> Path:
    """A head of kind ``of_kind``, hidden size ``size`` and depth 1 saved to ``directory``, then its
    config.json edited (``key=value``, or ``key=DROP`` to remove it) and, with ``cut``, its weights
    file truncated to half its bytes."""
    build_head(of_kind, size, 1, draft=draft).save_pretrained(directory)
    cfg_file = directory / CONFIG_NAME
    data = json.loads(cfg_file.read_text())
    for key, value in config.items():
        if value is DROP:
            del data[key]
        else:
            data[key] = value
    cfg_file.write_text(json.dumps(data))
    if cut:
        weights = directory / WEIGHTS_NAME
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return directory
