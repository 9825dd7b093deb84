"""BERT-style token mixing for training the acceptance head (SpecDec++ Section 3.3): the mixed
sequences Z and the draft's features at their Y-positions (the loss is in specdecpp.training.loss, the
metrics in specdecpp.training.metrics).

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
- For the lag-free head (kind ``next``): :func:`specdecpp.stopping.head.next_token_features` of the state
  one index earlier (after reading x, Z_<i: the state that produced q_i), of the draft's logits
  there and of the candidate Y_i, exactly what the engine has right after sampling y_k.
- Labels are probabilities; the head outputs a logit, P_hat = sigmoid(logit).
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.hooks import FinalHidden, keep_last
from ..models.reduced_vocab import scored_ids
from ..stopping.head import next_token_features

FIXED_MIXING_EPOCH = 0  # the mixing used by cached features and for validation
# Where a training feature is computed (``data.feature_context``): ``mixed`` the BERT-style mixed
# sequence Z (the paper's, the default); ``target`` the labels' own context x, X_<i (lag-free heads).
FEATURE_CONTEXTS = ("mixed", "target")


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
                   spec: dict | None = None, target=None):
    """Features and labels of the Y-positions of several dataset rows under the mixing of ``epoch``.

    ``rows``: dicts with ``row`` (index in its split), ``prompt_ids``, ``target_ids``, ``draft_ids``,
    ``p_acc``. ``spec``: the head's :meth:`feature_spec` (None: the paper's head). Returns (list of
    features [n_j, F], list of labels [n_j]), one entry per row. A feature draft's rows (their
    ``depth_*`` labels) need its ``target``: :func:`feature_draft_head_features`.
    """
    from ..models.feature_draft import FeatureDraft

    if isinstance(draft, FeatureDraft):
        if target is None:
            raise ValueError("a feature draft's head features need its target (the features it reads)")
        return feature_draft_head_features(draft, target, rows, spec or {})
    context = check_context(spec)
    if context == "target":
        return target_context_features(draft, rows, spec)
    examples = [mixed_example(r["prompt_ids"], r["target_ids"], r["draft_ids"], r["p_acc"],
                              mixing_mask(len(r["target_ids"]), ratio, seed, epoch, int(r["row"])))
                for r in rows]
    sequences, positions = [e[0] for e in examples], [e[1] for e in examples]
    if spec is None or spec.get("kind", "resnet") == "resnet":
        return draft_features(draft, sequences, positions), [e[2] for e in examples]
    hidden = draft_features(draft, sequences, [p - 1 for p in positions])  # the states that produced q_i
    return ([lag_free_features(draft, h, seq[pos], spec, pos - len(r["prompt_ids"]))
             for h, seq, pos, r in zip(hidden, sequences, positions, rows, strict=True)],
            [e[2] for e in examples])


def feature_draft_head_features(draft, target, rows: list[dict], spec: dict):
    """A head's features and labels for a feature draft's labels by depth (data_gen's ``depth_*``
    columns): every response token X_i at every depth d of a round where it has a label (row order:
    position i, then depth d), the candidate Y^(d)_i drawn there, exactly what the engine hands the
    head when a round drafts at X_i's place as its d-th candidate
    (:class:`specdecpp.models.feature_runner.FeaturePass`):

    - the lag-free head (``next``): the draft state that produced q^(d)_i, its logits there and Y^(d)_i;
    - the paper's head (``resnet``): the draft state after feeding Y^(d)_i on that state (one more
      unrolled step per depth, :meth:`~specdecpp.models.feature_draft.FeatureDraft.unrolled`'s probes).

    The labels' own context (``feature_context=target``) only: token mixing would put rejected tokens
    before later positions, where a feature draft reads the target's features, which no target forward
    over rejected tokens computes."""
    from ..models.feature_runner import FeaturePass

    kind = spec.get("kind", "resnet")
    if spec.get("context", "mixed") != "target":
        raise ValueError("a feature draft's heads train in the labels' own context (data.feature_context=target): "
                         "token mixing would need the target's features after rejected tokens, which no feature draft "
                         f"pass computes (got {spec.get('context', 'mixed')!r})")
    paper = kind == "resnet"
    depths = max(len(r["depth_p_acc"][0]) for r in rows if len(r["depth_p_acc"]))
    unrolled = FeaturePass(draft, target, [r["prompt_ids"] for r in rows], [r["target_ids"] for r in rows], depths,
                           candidates=[r["depth_draft_ids"] for r in rows] if paper else None)
    feats, labels = [], []
    for b, r in enumerate(rows):
        n = len(r["target_ids"])
        p_acc = torch.as_tensor(r["depth_p_acc"], dtype=torch.float32).reshape(n, -1)
        ids = torch.as_tensor(r["depth_draft_ids"], dtype=torch.long).reshape(n, -1)
        valid = ~p_acc.isnan()  # [n, D]: the (position, depth) pairs with a label, row-major
        out = None
        for d in range(1, p_acc.shape[1] + 1):
            at = valid[:, d - 1].nonzero().squeeze(-1)
            if not len(at):
                continue
            if paper:
                f = unrolled.after(b, d, 0, n)[at]
            else:
                f = lag_free_features(draft, unrolled.hidden(b, d, 0, n)[at], ids[at, d - 1], spec, at)
            out = f.new_zeros((n, p_acc.shape[1], f.shape[-1])) if out is None else out
            out[at, d - 1] = f
        feats.append(out[valid] if out is not None else torch.zeros((0, 0)))
        labels.append(p_acc[valid])
    return feats, labels


def feature_label_positions(depth_p_acc) -> int:
    """How many (position, depth) pairs of a feature draft's row carry a label."""
    return int((~torch.as_tensor(depth_p_acc, dtype=torch.float32).isnan()).sum())


def check_context(spec: dict | None, feature_draft: bool = False) -> str:
    """The feature context a training spec asks for (``spec['context']``, default ``mixed``).
    ``feature_draft``: labels of a feature draft, whose unrolled pass gives the paper's head its
    state in the target context too (:func:`feature_draft_head_features`)."""
    context = (spec or {}).get("context", "mixed")
    if context not in FEATURE_CONTEXTS:
        raise ValueError(f"data.feature_context must be one of {list(FEATURE_CONTEXTS)}, got {context!r}")
    if context == "target" and (spec or {}).get("kind", "resnet") == "resnet" and not feature_draft:
        raise ValueError("data.feature_context=target needs the lag-free head (head=next): the paper's head reads "
                         "the state at Y_i after X_<i, one draft forward per position; use feature_context=mixed")
    return context


def loss_positions(n_tokens: int, ratio: float, seed: int, epoch: int, row: int, context: str = "mixed") -> int:
    """How many positions of a response of ``n_tokens`` carry a loss (the feature cache's row count)."""
    if context == "target":
        return n_tokens
    return int((~mixing_mask(n_tokens, ratio, seed, epoch, row)).sum())


def target_context_features(draft, rows: list[dict], spec: dict):
    """The lag-free head's features in the labels' own context (``data.feature_context=target``):
    candidate Y_i scored from the draft state after x, X_<i, i.e. the state that produced the q_i
    Y_i was drawn from and P_i was computed with; every position carries a loss. In decoding a
    round's first candidate follows committed (target-distributed) tokens only, as here; BERT-style
    mixing instead puts the draft's rejected tokens into the context, where the label was not made."""
    sequences, positions, labels = [], [], []
    for r in rows:
        prompt = torch.as_tensor(r["prompt_ids"], dtype=torch.long)
        x = torch.as_tensor(r["target_ids"], dtype=torch.long)
        sequences.append(torch.cat([prompt, x]))
        positions.append(len(prompt) - 1 + torch.arange(len(x)))  # the state that produced q_i
        labels.append(torch.as_tensor(r["p_acc"], dtype=torch.float32))
    hidden = draft_features(draft, sequences, positions)
    feats = [lag_free_features(draft, h, torch.as_tensor(r["draft_ids"], dtype=torch.long), spec,
                               torch.arange(len(r["draft_ids"])))
             for h, r in zip(hidden, rows, strict=True)]
    return feats, labels


@torch.no_grad()
def lag_free_features(draft, hidden: torch.Tensor, tokens: torch.Tensor, spec: dict,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
    """The lag-free head's features of candidates ``tokens`` [n] drafted from the states ``hidden``
    [n, H] (the draft's logits recomputed from them by its output layer); ``positions`` [n] are the
    candidates' 0-based indices in the response (read by the ``position`` feature only)."""
    from ..models.feature_draft import FeatureDraft

    if isinstance(draft, FeatureDraft):  # its logits over the whole vocabulary, -inf off its own ids
        normed = hidden.to(draft.dtype) if draft.spec_config["norm_output"] else draft.norm(hidden.to(draft.dtype))
        logits = draft.full_logits(draft.lm_head(normed))
    else:
        logits = draft.get_output_embeddings()(hidden.to(draft.dtype))
    return next_token_features(hidden, logits, tokens.to(hidden.device), draft.get_input_embeddings(),
                               float(spec["temperature"]), tuple(spec["features"]),
                               **({"top_m": int(spec["top_m"])} if "top_m" in spec else {}),
                               positions=None if positions is None else positions.to(hidden.device),
                               support=scored_ids(draft))


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
