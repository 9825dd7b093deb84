"""specdecpp: learned stop predictors (SpecDec++) for speculative decoding, and its baselines."""

from . import _moved  # noqa: F401  round 3's module paths (specdecpp.head, ...), deprecated: docs/api.md
from .core.sampling import SamplingConfig, warp
from .core.verify import verify
from .decoders.cascade import Cascade
from .decoders.chain import SpeculativeDecoder
from .decoders.pearl import PEARLDecoder, PEARLStats
from .decoders.rounds import GenerateOutput, RunStats
from .decoders.sequoia import SequoiaDecoder, SequoiaStats
from .decoders.tree import TokenTree
from .hf import generate as hf_generate
from .models.feature_draft import FeatureDraft
from .models.identity import register_resolver
from .models.loading import load_pair
from .stopping.head import AcceptanceHead, NextTokenHead, load_head
from .stopping.policies import SVIP, FixedK, SpecDecPP, StopPolicy, TargetOnly

__version__ = "0.1.0"

__all__ = [
    "AcceptanceHead", "Cascade", "FeatureDraft", "FixedK", "GenerateOutput", "NextTokenHead", "PEARLDecoder",
    "PEARLStats", "RunStats",
    "SVIP", "SamplingConfig", "SequoiaDecoder", "SequoiaStats", "SpecDecPP", "SpeculativeDecoder", "StopPolicy",
    "TargetOnly", "TokenTree", "hf_generate", "load_head",
    "load_pair", "register_resolver", "verify", "warp",
]
