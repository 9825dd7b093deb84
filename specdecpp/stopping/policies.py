"""Stop policies: when does the draft stop proposing candidates and hand them to the target?

Every policy has one decision method. The engine drafts candidate ``y_k`` from ``q_k`` and then
asks ``should_stop(k, logits, hidden, token)``, where ``logits`` are the draft's raw logits that
produced ``q_k``, ``hidden`` is the draft's final hidden state at the same position, i.e. at
``y_{k-1}`` (at the last accepted token when k == 1), and ``token`` is ``y_k`` (a 0-d tensor). The engine also stops at
``max_candidates`` (0 = target-only decoding), at EOS and at the length limit. It never looks at
a policy's type.

A batch of rows (``SpeculativeDecoder.generate_batch``) asks the same question of every row at
once: ``stop_rows(k, logits [B, V], hidden [B, H], tokens [B], active [B]) -> bool tensor [B]``,
computed on the device (the engine reads the decisions once per draft step, never per row). The
built-in policies answer ``should_stop`` with the same arithmetic, one row's final steps in Python
floats (``SVIP``'s comparison, ``SpecDecPP``'s product; tested equal row by row); ``active`` marks
the rows still drafting (a row that stopped waits: its entries are filler and its answer unused).
"""

from __future__ import annotations

import math

import torch

from ..core.sampling import entropy
from ..models.reduced_vocab import ScoredIds
from .head import AcceptanceHead


def check_threshold(where: str, key: str, value) -> float:
    """A number in [0, 1] (not a bool, not NaN): the one check of every threshold setting, used by
    the policies and by infer's config checks (``where``/``key`` name it in the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or not 0.0 <= value <= 1.0:
        raise ValueError(f"{where}: {key} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_policy_keywords(where: str, head, threshold, stop_policy) -> None:
    """The stop-policy keywords of a call (``specdecpp.hf.generate``, ``specdecpp.vllm``): ``stop_policy``
    or ``head`` with its ``threshold``, never both; a threshold only with a head, and in (0, 1)."""
    if stop_policy is not None and (head is not None or threshold is not None):
        raise ValueError("give either stop_policy=... or head=... (with threshold=...), not both")
    if threshold is not None:
        check_threshold(where, "threshold", threshold)
        if head is None:
            raise ValueError("threshold=... is the SpecDec++ stop threshold of a head: give head=... as well")


def check_count(where: str, key: str, value, minimum: int = 1) -> int:
    """An integer >= ``minimum`` (not a bool): the one check of every count setting."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def check_candidates(where: str, min_candidates, max_candidates) -> tuple[int, int]:
    """Bounds on a round's candidates: integers >= 1, ``min_candidates <= max_candidates``."""
    low = check_count(where, "min_candidates", min_candidates)
    high = check_count(where, "max_candidates", max_candidates)
    if low > high:
        raise ValueError(f"{where}: min_candidates ({min_candidates}) > max_candidates ({max_candidates})")
    return low, high


def algorithm2_stops(p_all_accepted, k: int, threshold: float, min_candidates: int):
    """SpecDec++'s Algorithm 2: stop after candidate k once the chance that a scored candidate is
    rejected, 1 - prod P, passes ``threshold``, and k >= ``min_candidates``. For a float (the
    stop-potential replay, specdecpp/analysis/potential.py) or a tensor of rows (:class:`SpecDecPP`)."""
    return (1.0 - p_all_accepted > threshold) & (k >= min_candidates)


class StopPolicy:
    """Base class. Subclasses set ``max_candidates`` and implement ``should_stop``.

    What a policy needs, so the engine computes nothing more: ``needs_hidden`` (the draft's final
    hidden state; when False ``should_stop`` gets ``hidden=None`` and the draft runs without it) and
    ``reads_values`` (``should_stop`` reads tensor values on the host, a device sync per candidate on
    GPU; a policy that decides from ``k`` alone sets False, and the engine then adds no sync either).
    Both default to True, which is right for any policy; the built-in ones say what they use.
    ``needs_position`` (default False): the policy reads ``self.generated``, where each round starts
    in the response, which batch decoders then copy to the device once per round.
    """

    name = "policy"
    max_candidates: int = 0
    needs_hidden: bool = True
    reads_values: bool = True
    needs_position: bool = False  # reads where each round starts in the response (``begin_round``)

    def bind(self, draft_model, temperature: float) -> None:
        """Called once by the decoder: check compatibility with the draft, move state to its device."""

    def begin_round(self, generated=None) -> None:
        """What every decoder calls before the first candidate of each round: ``generated`` is how
        many response tokens are committed before it (an int, or a LongTensor [B] for a batch's rows;
        None from a decoder that does not say), so the round's k-th candidate is the response's token
        ``generated + k - 1`` (0-based). Stores it as ``self.generated``; a policy with round state
        resets it here too and calls ``super().begin_round(generated)``."""
        self.generated = generated

    def should_stop(self, k: int, logits: torch.Tensor, hidden: torch.Tensor,
                    token: torch.Tensor | None = None) -> bool:
        raise NotImplementedError

    def stop_rows(self, k: int, logits: torch.Tensor, hidden: torch.Tensor | None, tokens: torch.Tensor,
                  active: torch.Tensor) -> torch.Tensor:
        """One decision per row of a batch, as a bool tensor [B] on the rows' device: should row b
        stop after its candidate ``tokens[b]`` (the k-th of the round)? Needed by ``generate_batch``."""
        raise NotImplementedError(f"{type(self).__name__} decides one row at a time (should_stop); implement "
                                  "stop_rows(k, logits, hidden, tokens, active) to decode a batch with it")

    def settings(self) -> dict:
        return {}


class TargetOnly(StopPolicy):
    """No draft at all: every round is one target forward and one token (the baseline)."""

    name = "target_only"
    max_candidates = 0
    needs_hidden = reads_values = False

    def should_stop(self, k, logits, hidden, token=None) -> bool:
        return True

    def stop_rows(self, k, logits, hidden, tokens, active) -> torch.Tensor:
        return torch.ones_like(active)


class FixedK(StopPolicy):
    """Speculative decoding with a constant candidate length K."""

    name = "fixed_k"
    needs_hidden = reads_values = False

    def __init__(self, k: int = 4) -> None:
        self.k = check_count("FixedK", "k", k)
        self.max_candidates = self.k

    def should_stop(self, k, logits, hidden, token=None) -> bool:
        return k >= self.k  # from k alone: no tensor, no sync

    def stop_rows(self, k, logits, hidden, tokens, active) -> torch.Tensor:
        return torch.full_like(active, k >= self.k)

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
        if isinstance(c, bool) or not (isinstance(c, (int, float)) and c > 0):
            raise ValueError(f"SVIP: c must be > 0, got {c!r}")
        self.c = float(c)
        self.max_candidates = check_count("SVIP", "max_candidates", max_candidates)
        self.temperature = 1.0
        self.support = ScoredIds()  # the draft's scored token ids, where its output vocabulary is reduced

    def bind(self, draft_model, temperature: float) -> None:
        self.temperature = temperature
        self.support = ScoredIds(draft_model)

    def should_stop(self, k, logits, hidden, token=None) -> bool:
        """:meth:`stop_rows`'s decision for one row (as a batch of one: a 1-D row's reductions can
        round differently), its entropy read on the host and the comparison made in Python floats:
        the same float64 arithmetic in eleven tensor operations, where ``stop_rows`` on a batch of
        one and its read took nineteen. On a CPU each costs tens of microseconds after a forward has flushed the
        caches (docs/engine.md, "The loop on a CPU: cold caches")."""
        row = logits.unsqueeze(0)
        return self.c * float(entropy(row, self.temperature, self.support(row))) > self.threshold * self.threshold

    def stop_rows(self, k, logits, hidden, tokens, active) -> torch.Tensor:
        # sqrt(c H) > t as c H > t^2 (t >= 0), in float64: multiplications round the same in torch and
        # Python, where torch's CPU square root is not always the correctly rounded one (1 ulp off)
        h = entropy(logits, self.temperature, self.support(logits)).double()
        return self.c * h > self.threshold * self.threshold

    def settings(self) -> dict:
        return {"threshold": self.threshold, "c": self.c, "max_candidates": self.max_candidates}


class SpecDecPP(StopPolicy):
    """SpecDec++ (Algorithm 2): stop when 1 - prod_i sigmoid(head(.)) > threshold over the
    candidates of this round the head has scored, within [min, max] candidates.

    The head says what it can score (``head.lag``): the paper's head (``resnet``, lag 1) scores
    y_{k-1} from e_{k-1}, so after drafting y_k the product covers y_1..y_{k-1} and a round has
    at least two candidates; the lag-free head (``next``, lag 0) scores y_k itself from
    (e_{k-1}, q_k, y_k), so the product covers y_1..y_k and a round may stop after one."""

    name = "specdecpp"

    def __init__(self, head: AcceptanceHead, threshold: float = 0.7, min_candidates: int = 1,
                 max_candidates: int = 20) -> None:
        if not isinstance(head, AcceptanceHead):
            raise TypeError(f"SpecDecPP: head must be an AcceptanceHead or NextTokenHead, got {type(head).__name__}")
        self.head = head.eval()
        self.threshold = check_threshold("SpecDecPP", "threshold", threshold)
        self.min_candidates, self.max_candidates = check_candidates("SpecDecPP", min_candidates, max_candidates)
        self._p_all_accepted: torch.Tensor | None = None  # [B] float64, per row, this round
        self._p_one = 1.0  # the same for should_stop's one row
        self.last_accept: tuple[int, torch.Tensor] | None = None  # (k, [B] float64) of stop_rows' last scoring

    @property
    def needs_hidden(self) -> bool:
        """Asked of the head (the paper's head reads the draft's final hidden state)."""
        return self.head.needs_hidden

    @property
    def needs_position(self) -> bool:
        """Asked of the head (a lag-free head with the ``position`` feature)."""
        return self.head.needs_position

    def bind(self, draft_model, temperature: float) -> None:
        self.head.attach(draft_model)  # a lag-free head's q features use its training temperature

    def begin_round(self, generated=None) -> None:
        super().begin_round(generated)
        self._p_all_accepted = None
        self._p_one = 1.0
        self.last_accept = None

    @torch.no_grad()
    def should_stop(self, k, logits, hidden, token=None) -> bool:
        """:meth:`stop_rows` for one row, its product kept as a Python float: the same float64
        arithmetic and decision, without the tensor ops of a batch (the chain asks at every
        candidate)."""
        if k > self.head.lag:
            tokens = token.reshape(1)
            score = self.head.score(None if hidden is None else hidden.unsqueeze(0), logits.unsqueeze(0), tokens,
                                    self._positions(k, tokens))
            self._p_one *= float(torch.sigmoid(score))
        return bool(algorithm2_stops(self._p_one, k, self.threshold, self.min_candidates))

    @torch.no_grad()
    def stop_rows(self, k, logits, hidden, tokens, active) -> torch.Tensor:
        if self._p_all_accepted is None:  # the round's first call
            self._p_all_accepted = torch.ones(logits.shape[0], dtype=torch.float64, device=logits.device)
        # lag 0: y_k from e_{k-1} (hidden), q_k (logits) and y_k; lag 1: y_{k-1} from e_{k-1}
        if k > self.head.lag:
            accept = torch.sigmoid(self.head.score(hidden, logits, tokens, self._positions(k, tokens))).double()
            self._p_all_accepted *= accept
            self.last_accept = (k, accept)
        return algorithm2_stops(self._p_all_accepted, k, self.threshold, self.min_candidates)

    def _positions(self, k: int, tokens: torch.Tensor) -> torch.Tensor | None:
        """The response index of each row's candidate y_k (the ``position`` feature), else None."""
        if not self.needs_position:
            return None
        generated = getattr(self, "generated", None)
        if generated is None:
            raise RuntimeError("SpecDecPP: this head reads each candidate's position in the response (feature "
                               "`position`), and the decoder did not say where the round starts: decoders call "
                               "policy.begin_round(generated) before each round")
        base = torch.as_tensor(generated, device=tokens.device).reshape(-1)
        return (base + (k - 1)).expand(tokens.shape[0]) if base.numel() == 1 else base + (k - 1)

    def settings(self) -> dict:
        return {"threshold": self.threshold, "min_candidates": self.min_candidates,
                "max_candidates": self.max_candidates, "head_depth": self.head.depth,
                "head_kind": self.head.kind}
