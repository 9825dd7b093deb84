"""specdecpp: learned stop predictors (SpecDec++) for speculative decoding, and its baselines."""

from .cascade import Cascade
from .engine import GenerateOutput, RunStats, SpeculativeDecoder
from .head import AcceptanceHead, NextTokenHead, load_head
from .identity import register_resolver
from .loading import load_pair
from .pearl import PEARLDecoder, PEARLStats
from .policies import SVIP, FixedK, SpecDecPP, StopPolicy, TargetOnly
from .sampling import SamplingConfig, warp
from .sequoia import SequoiaDecoder, SequoiaStats
from .tree import TokenTree
from .verify import verify

__version__ = "0.1.0"

__all__ = [
    "AcceptanceHead", "Cascade", "FixedK", "GenerateOutput", "NextTokenHead", "PEARLDecoder", "PEARLStats", "RunStats",
    "SVIP", "SamplingConfig", "SequoiaDecoder", "SequoiaStats", "SpecDecPP", "SpeculativeDecoder", "StopPolicy",
    "TargetOnly", "TokenTree", "load_head",
    "load_pair", "register_resolver", "verify", "warp",
]
