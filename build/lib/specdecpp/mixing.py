"""Training math for the acceptance head (SpecDec++ Section 3.3): token mixing, the draft's
features at the mixed tokens, the weighted soft-label BCE, binary KL and calibration helpers.

Conventions, per prompt with response length N:
- ``target_ids`` X_1..X_N (sampled from the target), ``draft_ids`` Y_1..Y_N (Y_i ~ q(.|x, X_<i)),
  ``p_acc`` P_i = min(1, p(Y_i)/q(Y_i)).
- The mixing mask ``take_target[i]`` is True where Z_i = X_i (probability r), else Z_i = Y_i.
- The loss uses the positions "Z_i taken from Y_i" (``~take_target``), as in the paper's loss and
  the authors' code: a position whose mask chose X_i is left out even when X_i == Y_i, so the
  label distribution is not tilted towards tokens the draft and target agree on.
- Feature of position i for the paper's head (kind ``resnet``): the draft's final hidden state
  (``hidden_states[-1]``, after the final norm) output at token Z_i, i.e. after reading
  x, Z_1..Z_i: index ``len(prompt) + i - 1`` of the sequence x + Z (1-based i). This is e_i,
  exactly what the engine hands the head at inference.
- For the lag-free head (kind ``next``): :func:`specdecpp.head.next_token_features` of the state
  one index earlier (after reading x, Z_<i: the state that produced q_i), of the draft's logits
  there and of the candidate Y_i, exactly what the engine has right after sampling y_k.
- Labels are probabilities; the head outputs a logit, P_hat = sigmoid(logit).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .head import next_token_features
from .hooks import FinalHidden, keep_last

FIXED_MIXING_EPOCH = 0  # the mixing used by cached features and for validation


# -- token mixing ----------------------------------------------------------------------------
def mixing_mask(n_tokens: int, ratio: float, seed: int, epoch: int, row: int) -> torch.Tensor:
    """Bool mask [n_tokens], True where Z_i takes the target token X_i (probability ``ratio``).

    Deterministic in (seed, epoch, row): the same row of a dataset gets the same mixing in every
    process, which lets cached features and on-the-fly features see identical inputs.
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"mixing ratio must be in [0, 1), got {ratio!r}")
    rng = np.random.default_rng([int(seed), int(epoch), int(row)])
    return torch.from_numpy(rng.random(n_tokens) < ratio)


def mix_tokens(target_ids: torch.Tensor, draft_ids: torch.Tensor, take_target: torch.Tensor) -> torch.Tensor:
    """Z = X where ``take_target`` else Y."""
    if not (target_ids.shape == draft_ids.shape == take_target.shape):
        raise ValueError(f"target_ids {tuple(target_ids.shape)}, draft_ids {tuple(draft_ids.shape)} and "
                         f"mask {tuple(take_target.shape)} must have one shape")
    return torch.where(take_target, target_ids, draft_ids)


def mixed_example(prompt_ids, target_ids, draft_ids, p_acc, take_target: torch.Tensor):
    """(input_ids = x + Z, feature positions into input_ids, labels at those positions)."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    x, y = torch.as_tensor(target_ids, dtype=torch.long), torch.as_tensor(draft_ids, dtype=torch.long)
    take_target = take_target.to(x.device)
    z = mix_tokens(x, y, take_target)
    keep = (~take_target).nonzero().squeeze(-1)
    positions = len(prompt) + keep  # Z_{i+1} (0-based i) sits at index len(prompt) + i
    labels = torch.as_tensor(p_acc, dtype=torch.float32).to(x.device)[keep]
    return torch.cat([prompt, z]), positions, labels


def mixed_features(draft, rows: list[dict], ratio: float, seed: int, epoch: int = FIXED_MIXING_EPOCH,
                   spec: dict | None = None):
    """Features and labels of the Y-positions of several dataset rows under the mixing of ``epoch``.

    ``rows``: dicts with ``row`` (index in its split), ``prompt_ids``, ``target_ids``, ``draft_ids``,
    ``p_acc``. ``spec``: the head's :meth:`feature_spec` (None: the paper's head). Returns (list of
    features [n_j, F], list of labels [n_j]), one entry per row.
    """
    examples = [mixed_example(r["prompt_ids"], r["target_ids"], r["draft_ids"], r["p_acc"],
                              mixing_mask(len(r["target_ids"]), ratio, seed, epoch, int(r["row"])))
                for r in rows]
    sequences, positions = [e[0] for e in examples], [e[1] for e in examples]
    if spec is None or spec.get("kind", "resnet") == "resnet":
        return draft_features(draft, sequences, positions), [e[2] for e in examples]
    hidden = draft_features(draft, sequences, [p - 1 for p in positions])  # the states that produced q_i
    return ([lag_free_features(draft, h, seq[pos], spec) for h, seq, pos in zip(hidden, sequences, positions, strict=True)],
            [e[2] for e in examples])


@torch.no_grad()
def lag_free_features(draft, hidden: torch.Tensor, tokens: torch.Tensor, spec: dict) -> torch.Tensor:
    """The lag-free head's features of candidates ``tokens`` [n] drafted from the states ``hidden``
    [n, H] (the draft's logits recomputed from them by its output layer)."""
    logits = draft.get_output_embeddings()(hidden.to(draft.dtype))
    return next_token_features(hidden, logits, tokens.to(hidden.device), draft.get_input_embeddings(),
                               float(spec["temperature"]), tuple(spec["features"]))


@torch.no_grad()
def draft_features(draft, sequences: list[torch.Tensor], positions: list[torch.Tensor]) -> list[torch.Tensor]:
    """The draft's final hidden states at ``positions[j]`` of ``sequences[j]``, one forward pass
    for the batch (right padding, so causal attention keeps the real positions exact)."""
    device = draft.device
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long, device=device)
    attention = torch.zeros_like(ids)
    for j, seq in enumerate(sequences):
        ids[j, : len(seq)] = seq.to(device)
        attention[j, : len(seq)] = 1
    with FinalHidden(draft) as final:  # the last layer's states only, not every layer's
        hidden = final.take(draft(input_ids=ids, attention_mask=attention,
                                  logits_to_keep=keep_last(ids.shape[1], 1, ids.device), **final.kwargs))
    return [hidden[j, pos.to(device)] for j, pos in enumerate(positions)]


# -- loss and metrics --------------------------------------------------------------------------
def weighted_bce(logits: torch.Tensor, p_acc: torch.Tensor, w_rej: float, w_acc: float = 1.0) -> torch.Tensor:
    """Soft-label weighted BCE, normalised by the label weight of the batch (authors' code):

        sum_i [ -w_acc P_i log P_hat_i - w_rej (1 - P_i) log(1 - P_hat_i) ] / (w_rej sum(1 - P) + w_acc sum(P))

    An empty batch (no Y-positions) gives a zero loss that still carries a graph.
    """
    logits, p = logits.float(), p_acc.float()
    if logits.numel() == 0:
        return logits.sum() * 0.0
    per_token = w_acc * p * F.softplus(-logits) + w_rej * (1 - p) * F.softplus(logits)
    return per_token.sum() / (w_rej * (1 - p).sum() + w_acc * p.sum())


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """H(P) in nats, with 0 log 0 = 0."""
    p = p.float()
    return -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))


def binary_kl(logits: torch.Tensor, p_acc: torch.Tensor) -> torch.Tensor:
    """Per-position KL(P || P_hat) = BCE(P, P_hat) - H(P) (unweighted; the paper's train/eval KL)."""
    logits, p = logits.float(), p_acc.float()
    bce = p * F.softplus(-logits) + (1 - p) * F.softplus(logits)
    return bce - binary_entropy(p)


def calibration_bins(prob: torch.Tensor, p_acc: torch.Tensor, n_bins: int = 15):
    """Per-bin (count, sum of predicted P_hat, sum of labels P) over equal-width bins of P_hat.

    Binning as torchmetrics' calibration error (``n_bins + 1`` slots; P_hat = 1 lands in the
    last). Soft labels enter as their expectation: P_i is the probability that the candidate is
    accepted, so the bin's mean label is its expected acceptance rate.
    """
    prob, p = prob.detach().float().flatten(), p_acc.detach().float().flatten()
    edges = torch.linspace(0, 1, n_bins + 1, device=prob.device)
    index = torch.bucketize(prob, edges, right=True) - 1
    zeros = torch.zeros(n_bins + 1, device=prob.device)
    return (zeros.scatter_add(0, index, torch.ones_like(prob)), zeros.scatter_add(0, index, prob),
            zeros.scatter_add(0, index, p))


def expected_calibration_error(count: torch.Tensor, sum_prob: torch.Tensor, sum_label: torch.Tensor) -> torch.Tensor:
    """ECE = sum_b (n_b / n) |mean P_hat_b - mean P_b| (L1), from :func:`calibration_bins` sums."""
    total = count.sum()
    if total == 0:
        return torch.tensor(float("nan"))
    return (sum_prob - sum_label).abs().sum() / total


def soft_auroc(scores: torch.Tensor, positive_weight: torch.Tensor, negative_weight: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve where each item counts as positive with weight ``positive_weight``
    and as negative with ``negative_weight`` (ties get half credit). With 0/1 weights this is the
    ordinary AUROC; with soft labels it is the AUROC expected over the labels' Bernoulli draws.
    NaN when either class has no weight."""
    scores, wp, wn = (t.detach().double().flatten() for t in (scores, positive_weight, negative_weight))
    total_p, total_n = wp.sum(), wn.sum()
    if total_p <= 0 or total_n <= 0:
        return torch.tensor(float("nan"))
    order = torch.argsort(scores, descending=True)
    _, group = torch.unique_consecutive(scores[order], return_inverse=True)
    n_groups = int(group.max()) + 1
    tp = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).scatter_add(0, group, wp[order])
    fp = torch.zeros_like(tp).scatter_add(0, group, wn[order])
    tpr = torch.cat([tp.new_zeros(1), tp.cumsum(0) / total_p])
    fpr = torch.cat([fp.new_zeros(1), fp.cumsum(0) / total_n])
    return torch.trapezoid(tpr, fpr).float()


def rejection_auroc(logits: torch.Tensor, p_acc: torch.Tensor) -> torch.Tensor:
    """How well the head ranks rejections: AUROC of the score -logit (predicted rejection) against
    the rejection event, each position weighted 1 - P_i as a rejection and P_i as an acceptance."""
    p = p_acc.float()
    return soft_auroc(-logits.float(), 1 - p, p)
