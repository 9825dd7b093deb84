"""The repository's root and its Hydra config directory, for tests in any folder."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
