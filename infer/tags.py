"""Result file names: ``<method tag>[_b<B>][_fill][_fast-<backend>]__<sampling tag>__s<seed>.jsonl``.

A method's tag is made from its ``settings()`` alone (the dict every row records), by one rule for
every method: the settings named in :data:`PREFIXES`, in the method's ``tag_keys`` order (default:
the order of its settings), each written as its prefix and its value (a float as ``%g``, a path by
its last part, a list by a short hash), joined by ``_``; e.g. SVIP's ``{"threshold": 0.3, "c":
0.15, "max_candidates": 40}`` is ``h0.3_c0.15_max40``. A dotted key reads a nested setting (a
cascade's ``policy.k``). A method with nothing to tag is named by its name (target-only: ``base``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specdecpp.core.sampling import SamplingConfig

# setting -> its prefix in a tag; the settings not listed (head_sha, head_kind, head_depth,
# switch_interval, tree_source, expected_tokens, lossy, ...) do not name a result file
PREFIXES = {"head": "", "mode": "", "rule": "", "stop": "", "parents": "", "gamma": "g", "k": "k",
            "threshold": "h", "c": "c", "confidence_threshold": "c", "min_candidates": "min",
            "max_candidates": "max", "num_assistant_tokens": "n", "alpha": "a", "tree_size": "n", "tree_depth": "d",
            "num_threads": "t"}
# values a tag leaves out: one thread (the default), and a stop policy that its own settings name
# already (fixed K by its k, SpecDec++ by its head) or no stop policy
UNTAGGED = {"num_threads": (1,), "stop": (None, "fixed_k", "specdecpp")}
EMPTY_TAGS = {"target_only": "base"}


def _setting(settings: dict, key: str) -> tuple[bool, object]:
    value = settings
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _value(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return hashlib.sha256(json.dumps(list(value)).encode()).hexdigest()[:8]
    if isinstance(value, str):
        return Path(value.rstrip("/")).name  # a head directory (or hub id) by its name
    return str(value)


def method_tag(name: str, settings: dict, tag_keys=None) -> str:
    """The file-name tag of a method's settings (see the module docstring)."""
    parts = []
    for key in tag_keys or settings:
        found, value = _setting(settings, key)
        leaf = key.rsplit(".", 1)[-1]
        if found and leaf in PREFIXES and value not in UNTAGGED.get(leaf, ()):
            parts.append(PREFIXES[leaf] + _value(value))
    return "_".join(parts) or EMPTY_TAGS.get(name, name)


def sampling_tag(s: SamplingConfig) -> str:
    return "greedy" if s.greedy else f"t{s.temperature:g}-k{s.top_k}-p{s.top_p:g}"


def rounds_suffix(capture_rounds: bool | str, sep: str) -> str:
    """What a run's file tag (``sep`` "_") or report tag ("+") adds for ``capture_rounds``: nothing
    for the default (rounds captured where they can be), ``fused`` or ``per-forward``."""
    return "" if capture_rounds is True else sep + ("fused" if capture_rounds == "fused" else "per-forward")


def result_path(out_dir, tag: str, sampling: SamplingConfig, seed: int, batch_size: int = 1,
                batch_fill: bool = False, fast: str | None = None, capture_rounds: bool | str = True) -> Path:
    """Where a run's rows go: ``tag`` is the method's (:func:`method_tag`); ``fast`` (the fast
    path's backend) names the file only when set, so eager runs keep their paths; so does
    ``capture_rounds`` when not the default (``_fused``, ``_per-forward``)."""
    tag = (tag + (f"_b{batch_size}" if batch_size > 1 else "") + ("_fill" if batch_fill else "")
           + (f"_fast-{fast}" if fast else "") + rounds_suffix(capture_rounds, "_"))
    return Path(str(out_dir)) / f"{tag}__{sampling_tag(sampling)}__s{seed}.jsonl"
