"""Token windows of existing text (Python standard-library source by default), the cheap teacher data
both demo drafts' builds label with the target (specdecpp_demo/build_draft.py, build_feature_draft.py)."""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import numpy as np


def text_files(patterns: list[str]) -> list[Path]:
    """Files matching the glob patterns; ``{stdlib}`` stands for this Python's standard library."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = set()
    for pattern in patterns:
        pattern = pattern.format(stdlib=stdlib)
        files.update(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    return sorted(files)


def text_windows(tokenizer, files: list[Path], count: int, window: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``window`` token ids from the files in a seeded order, EOS between files."""
    order = np.random.default_rng(seed).permutation(len(files))
    stream, windows = [], []
    for i in order:
        stream += tokenizer(files[i].read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        stream.append(tokenizer.eos_token_id)
        while len(stream) >= window and len(windows) < count:
            windows.append(stream[:window])
            stream = stream[window:]
        if len(windows) == count:
            return windows
    raise ValueError(f"the text files give only {len(windows)} windows of {window} tokens; {count} wanted")
