"""vLLM's online acceptance estimator as a stop policy: the baseline beside a trained head (docs/vllm.md).

vLLM 0.32's Model Runner V2 (``vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py``, CUDA and
Triton only) estimates each draft position's acceptance as ``sigmoid(w * f + b_k)``: ``f`` is the
log-odds of the draft distribution's most likely token, ``log(q_max / (1 - q_max))`` at the sampling
temperature (clamped to +-40), a function of the prefix alone (not of the drawn token, so trimming a
draft on it stays exact); ``w`` is one slope shared by all positions, ``b_k`` one intercept per
position, both calibrated while serving by Newton-IRLS on the verification outcomes (each accepted
candidate labelled 1, the first rejected one 0, later ones unobserved), refitted every 100 steps,
each step damped by ``n / (n + 50)`` for its n observations, ridge 1e-3, the slope kept >= 0, from
the cold start ``w = 0.5, b_k = -0.2``. :class:`OnlineAcceptanceEstimator` is that, in torch on any
device; :class:`OnlineAcceptance` is a stop policy on it: stop once the chance that some candidate of
the round is rejected, ``1 - prod_k sigmoid(w f_k + b_k)``, passes ``threshold`` (SpecDec++'s rule
with the estimator in place of the head). Where nobody feeds it outcomes (``observe``) it stays at
its cold start; ``specdecpp.vllm``'s proposer feeds it every step.
"""

from __future__ import annotations

import torch

from ..stopping.policies import StopPolicy, check_count, check_threshold

MAX_LOG_ODDS = 40.0
INIT_SLOPE = 0.5
INIT_BIAS = -0.2


def max_log_odds(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B] float64: ``log(q_max / (1 - q_max))`` of each row's draft distribution ``softmax(logits / T)``
    (raw logits at T = 0, as vLLM's sampler drafts greedily there), clamped to +-:data:`MAX_LOG_ODDS`.
    Computed as ``-log sum_{j != max} exp(z_j - z_max)`` in float32 (no 1 - q_max to lose precision in; a
    sum that underflows gives +inf, clamped): it runs on every draft pass over a [batch, vocabulary] table
    (its cost: docs/results/serve.md)."""
    z = logits.float()
    if temperature > 0:
        z = z / temperature
    top = z.max(dim=-1, keepdim=True)
    others = (z - top.values).exp_().scatter_(-1, top.indices, 0.0)
    return (-torch.log(others.sum(dim=-1))).double().clamp(-MAX_LOG_ODDS, MAX_LOG_ODDS)


class OnlineAcceptanceEstimator:
    """Per-position acceptance ``sigmoid(slope * f + intercepts[k])``, calibrated from verification
    outcomes (module docstring): :meth:`predict` at draft time, :meth:`observe` once the target has
    verified, which refits every ``refit_interval`` observed steps."""

    def __init__(self, positions: int, refit_interval: int = 100, damping: float = 50.0, l2: float = 1e-3) -> None:
        self.positions = check_count("OnlineAcceptanceEstimator", "positions", positions)
        self.refit_interval = check_count("OnlineAcceptanceEstimator", "refit_interval", refit_interval)
        if not (damping >= 0 and l2 > 0):
            raise ValueError(f"OnlineAcceptanceEstimator: damping must be >= 0 and l2 > 0, got {damping}, {l2}")
        self.damping, self.l2 = float(damping), float(l2)
        self.slope = INIT_SLOPE
        self.intercepts = torch.full((positions,), INIT_BIAS, dtype=torch.float64)
        self.refits = 0
        self._steps = 0
        self._clear()

    def _clear(self) -> None:
        self._info = torch.zeros(self.positions, 3, dtype=torch.float64)  # per position: sum w f^2, w f, w
        self._grad = torch.zeros(self.positions, 2, dtype=torch.float64)  # per position: sum r f, r
        self._counts = torch.zeros(self.positions, dtype=torch.float64)

    def predict(self, features: torch.Tensor, k: int) -> torch.Tensor:
        """[B] float64 acceptance estimates of candidates at position ``k`` (1-based; positions beyond
        the last use its intercept) from their features (:func:`max_log_odds`)."""
        b = self.intercepts[min(k, self.positions) - 1].to(features.device)
        return torch.sigmoid(self.slope * features.double() + b)

    def observe(self, features: torch.Tensor, num_drafted, num_accepted, predictions: torch.Tensor | None = None
                ) -> None:
        """One verified step: ``features`` [n, K] of n requests' drafted positions (entries past a request's
        ``num_drafted`` are ignored), how many candidates each drafted and how many the target accepted;
        ``predictions`` [n, K] the estimates made at draft time (default: the current fit's). The accepted
        candidates are labelled 1 and the first rejected one 0 (vLLM's rule); the IRLS sums grow."""
        features = features.detach().double().cpu()
        if features.dim() != 2:
            raise ValueError(f"observe: features must be [requests, positions], got shape {tuple(features.shape)}")
        n, width = features.shape
        drafted = torch.as_tensor(num_drafted, dtype=torch.long).reshape(-1).cpu()
        accepted = torch.as_tensor(num_accepted, dtype=torch.long).reshape(-1).cpu()
        if drafted.numel() != n or accepted.numel() != n:
            raise ValueError(f"observe: num_drafted and num_accepted need {n} entries (one per request)")
        if (accepted < 0).any() or (accepted > drafted).any() or (drafted > width).any():
            raise ValueError("observe: need 0 <= num_accepted <= num_drafted <= the features' positions")
        width = min(width, self.positions)
        features = features[:, :width]
        if predictions is None:
            predictions = torch.sigmoid(self.slope * features + self.intercepts[:width])
        predictions = predictions.detach().double().cpu()[:, :width]
        step = torch.arange(width).unsqueeze(0)
        observed = (step <= accepted.unsqueeze(1)) & (step < drafted.unsqueeze(1))
        label = (step < accepted.unsqueeze(1)).double()
        w = torch.where(observed, predictions * (1 - predictions), 0.0)
        resid = torch.where(observed, label - predictions, 0.0)
        f = torch.where(observed, features, 0.0)
        self._info[:width] += torch.stack([(w * f * f).sum(0), (w * f).sum(0), w.sum(0)], dim=1)
        self._grad[:width] += torch.stack([(resid * f).sum(0), resid.sum(0)], dim=1)
        self._counts[:width] += observed.double().sum(0)
        self._steps += 1
        if self._steps >= self.refit_interval:
            self.refit()

    def refit(self) -> None:
        """One damped Newton step on the sums since the last refit (vLLM's arrowhead solve of
        ``(X^T W X + l2 I) d = X^T (y - p)`` for the shared slope and the per-position intercepts)."""
        self._steps = 0
        a = float(self._info[:, 0].sum()) + self.l2
        b = self._info[:, 1]
        c = self._info[:, 2] + self.l2
        g0 = float(self._grad[:, 0].sum())
        g1 = self._grad[:, 1]
        n = self._counts
        step_w = (g0 - float((b * g1 / c).sum())) / (a - float((b * b / c).sum()))
        total = float(n.sum())
        step_w *= total / (total + self.damping) if total + self.damping > 0 else 0.0
        if step_w != step_w or self.slope + step_w < 0:
            step_w = 0.0
        self.slope += step_w
        step_b = (g1 - b * step_w) / c * (n / (n + self.damping)).nan_to_num(0.0)
        self.intercepts += step_b.nan_to_num(0.0)
        self.refits += 1
        self._clear()


class OnlineAcceptance(StopPolicy):
    """Stop once ``1 - prod_k a_k > threshold`` over the round's candidates, ``a_k`` vLLM's online
    acceptance estimate of candidate k (module docstring), within ``max_candidates``. ``last_accept``
    holds the latest pass's estimates and ``round_features`` the round's features, for whoever feeds
    the estimator its outcomes (:meth:`OnlineAcceptanceEstimator.observe`)."""

    name = "online_acceptance"
    needs_hidden = False  # the draft's logits only

    def __init__(self, threshold: float = 0.7, max_candidates: int = 4, refit_interval: int = 100) -> None:
        self.threshold = check_threshold("OnlineAcceptance", "threshold", threshold)
        self.max_candidates = check_count("OnlineAcceptance", "max_candidates", max_candidates)
        self.refit_interval = check_count("OnlineAcceptance", "refit_interval", refit_interval)
        self.estimator = OnlineAcceptanceEstimator(self.max_candidates, self.refit_interval)
        self.temperature = 1.0
        self.begin_round(None)

    def bind(self, draft_model, temperature: float) -> None:
        self.temperature = temperature

    def begin_round(self, generated=None) -> None:
        super().begin_round(generated)
        self._survival: torch.Tensor | None = None
        self._survival_one = 1.0
        self.last_accept: torch.Tensor | None = None
        self.features: list[torch.Tensor] = []  # per pass: [B] float64
        self.predictions: list[torch.Tensor] = []

    def estimate(self, k: int, logits: torch.Tensor) -> torch.Tensor:
        """[B] estimates for this pass's candidates from the draft's raw ``logits`` [B, V], recorded."""
        features = max_log_odds(logits, self.temperature)
        accept = self.estimator.predict(features, k)
        self.features.append(features)
        self.predictions.append(accept)
        self.last_accept = accept
        return accept

    @torch.no_grad()
    def stop_rows(self, k, logits, hidden, tokens, active) -> torch.Tensor:
        accept = self.estimate(k, logits)
        self._survival = accept if self._survival is None else self._survival * accept
        return 1.0 - self._survival > self.threshold

    @torch.no_grad()
    def should_stop(self, k, logits, hidden, token=None) -> bool:
        accept = float(self.estimate(k, logits.unsqueeze(0))[0])
        self._survival_one *= accept
        return 1.0 - self._survival_one > self.threshold

    def round_features(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[B, passes] features and estimates of the round so far (None before the first pass)."""
        if not self.features:
            return None
        return torch.stack(self.features, dim=1), torch.stack(self.predictions, dim=1)

    def settings(self) -> dict:
        return {"threshold": self.threshold, "max_candidates": self.max_candidates,
                "refit_interval": self.refit_interval}
