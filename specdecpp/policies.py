"""Stop policies: when does the draft stop proposing candidates and hand them to the target?

Every policy has one decision method. The engine drafts candidate ``y_k`` from ``q_k`` and then
asks ``should_stop(k, logits, hidden)``, where ``logits`` are the draft's raw logits that
produced ``q_k`` and ``hidden`` is the draft's final hidden state at the same position, i.e. at
``y_{k-1}`` (at the last accepted token when k == 1). The engine also stops at
``max_candidates`` (0 = target-only decoding), at EOS and at the length limit. It never looks at
a policy's type.
"""

from __future__ import annotations

import math

import torch

from .head import AcceptanceHead
from .sampling import entropy


def check_threshold(where: str, key: str, value) -> float:
    """A number in [0, 1] (not a bool, not NaN): the one check of every threshold setting, used by
    the policies and by infer's config checks (``where``/``key`` name it in the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or not 0.0 <= value <= 1.0:
        raise ValueError(f"{where}: {key} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_count(where: str, key: str, value, minimum: int = 1) -> int:
    """An integer >= ``minimum`` (not a bool): the one check of every count setting."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


class StopPolicy:
    """Base class. Subclasses set ``max_candidates`` and implement ``should_stop``.

    What a policy needs, so the engine computes nothing more: ``needs_hidden`` (the draft's final
    hidden state; when False ``should_stop`` gets ``hidden=None`` and the draft runs without it) and
    ``reads_values`` (``should_stop`` reads tensor values on the host, a device sync per candidate on
    GPU; a policy that decides from ``k`` alone sets False, and the engine then adds no sync either).
    Both default to True, which is right for any policy; the built-in ones say what they use.
    """

    name = "policy"
    max_candidates: int = 0
    needs_hidden: bool = True
    reads_values: bool = True

    def bind(self, draft_model, temperature: float) -> None:
        """Called once by the decoder: check compatibility with the draft, move state to its device."""

    def new_round(self) -> None:
        """Called before the first candidate of each round."""

    def should_stop(self, k: int, logits: torch.Tensor, hidden: torch.Tensor) -> bool:
        raise NotImplementedError

    def settings(self) -> dict:
        return {}


class TargetOnly(StopPolicy):
    """No draft at all: every round is one target forward and one token (the baseline)."""

    name = "target_only"
    max_candidates = 0
    needs_hidden = reads_values = False

    def should_stop(self, k, logits, hidden) -> bool:
        return True


class FixedK(StopPolicy):
    """Speculative decoding with a constant candidate length K."""

    name = "fixed_k"
    needs_hidden = reads_values = False

    def __init__(self, k: int = 4) -> None:
        self.k = check_count("FixedK", "k", k)
        self.max_candidates = self.k

    def should_stop(self, k, logits, hidden) -> bool:
        return k >= self.k

    def settings(self) -> dict:
        return {"k": self.k}


class SVIP(StopPolicy):
    """Stop once sqrt(c * H(q_k)) > threshold (SVIP, Zhang et al.; c = 0.15 as in the authors' code).

    H is the natural-log entropy of the full-vocabulary softmax of the draft logits at the
    decoding temperature (raw softmax under greedy decoding), of the distribution the
    just-drafted token came from.
    """

    name = "svip"
    needs_hidden = False  # the entropy of the draft's logits only

    def __init__(self, threshold: float = 0.3, c: float = 0.15, max_candidates: int = 40) -> None:
        self.threshold = check_threshold("SVIP", "threshold", threshold)
        if not (isinstance(c, (int, float)) and c > 0):
            raise ValueError(f"SVIP: c must be > 0, got {c!r}")
        self.c = float(c)
        self.max_candidates = check_count("SVIP", "max_candidates", max_candidates)
        self.temperature = 1.0

    def bind(self, draft_model, temperature: float) -> None:
        self.temperature = temperature

    def should_stop(self, k, logits, hidden) -> bool:
        h = float(entropy(logits, self.temperature))
        return math.sqrt(self.c * h) > self.threshold

    def settings(self) -> dict:
        return {"threshold": self.threshold, "c": self.c, "max_candidates": self.max_candidates}


class SpecDecPP(StopPolicy):
    """SpecDec++ (Algorithm 2): stop when 1 - prod_i sigmoid(head(e_i)) > threshold, over the
    candidates e_1.. of this round whose hidden states are known, within [min, max] candidates."""

    name = "specdecpp"

    def __init__(self, head: AcceptanceHead, threshold: float = 0.7, min_candidates: int = 1,
                 max_candidates: int = 20) -> None:
        if not isinstance(head, AcceptanceHead):
            raise TypeError(f"SpecDecPP: head must be an AcceptanceHead, got {type(head).__name__}")
        self.head = head.eval()
        self.threshold = check_threshold("SpecDecPP", "threshold", threshold)
        self.min_candidates = check_count("SpecDecPP", "min_candidates", min_candidates)
        self.max_candidates = check_count("SpecDecPP", "max_candidates", max_candidates)
        if self.min_candidates > self.max_candidates:
            raise ValueError(f"SpecDecPP: min_candidates ({min_candidates}) > max_candidates ({max_candidates})")
        self._p_all_accepted = 1.0

    @property
    def needs_hidden(self) -> bool:
        """Asked of the head (the paper's head reads the draft's final hidden state)."""
        return self.head.needs_hidden

    def bind(self, draft_model, temperature: float) -> None:
        self.head.check_draft(draft_model)
        self.head.to(draft_model.device)

    def new_round(self) -> None:
        self._p_all_accepted = 1.0

    @torch.no_grad()
    def should_stop(self, k, logits, hidden) -> bool:
        if k >= 2:  # hidden is e_{k-1}, the state at candidate y_{k-1} of this round
            self._p_all_accepted *= float(torch.sigmoid(self.head(hidden.float())))
        return k >= self.min_candidates and 1.0 - self._p_all_accepted > self.threshold

    def settings(self) -> dict:
        return {"threshold": self.threshold, "min_candidates": self.min_candidates,
                "max_candidates": self.max_candidates, "head_depth": self.head.depth}
