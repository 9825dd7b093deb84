"""Reduced output vocabularies: a draft that scores only some tokens (q is exactly zero elsewhere),
declared by a file in its model directory that :func:`specdecpp.models.loading.load_model` applies."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def output_vocab_size(model) -> int:
    """Tokens the model scores (a reduced output layer still scores the whole vocabulary, and so
    does a feature draft over its draft vocabulary)."""
    from .feature_draft import FeatureDraft

    if isinstance(model, FeatureDraft):
        return model.vocab_size
    layer = model.get_output_embeddings()
    return int(getattr(layer, "out_features", None) or layer.weight.shape[0])


def scored_ids(model) -> torch.Tensor | None:
    """The sorted token ids a reduced output layer scores (its logits elsewhere are -inf), or None
    when the model scores its whole vocabulary. A statistic of the draft's softmax (an entropy, a
    token's log-probability) reads only these logits and is the same: the -inf ones add nothing,
    and skipping them leaves fewer logits (a quarter for a draft scoring 12k of 49k tokens), none
    of them -inf, whose ``exp`` is slow on a CPU (docs/results/fast.md, "The loop's policy work")."""
    from .feature_draft import FeatureDraft

    if isinstance(model, FeatureDraft):
        return model.token_ids if model.draft_vocab_size < model.vocab_size else None
    layer = model.get_output_embeddings()
    return layer.token_ids if isinstance(layer, ReducedOutput) else None


class ScoredIds:
    """A draft's :func:`scored_ids` cut to the width of the logits at hand (a decoder may keep
    only the vocabulary the draft shares with the target), cut once per width. Calling it with
    logits [..., V] gives the ids below V, or None where the draft scores its whole vocabulary."""

    def __init__(self, model=None) -> None:
        self.ids = None if model is None else scored_ids(model)
        self._cut: dict[int, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor) -> torch.Tensor | None:
        if self.ids is None:
            return None
        width = logits.shape[-1]
        if width not in self._cut:
            self._cut[width] = self.ids[self.ids < width]
        return self._cut[width]


OUTPUT_VOCAB_FILE = "specdecpp_output_vocab.json"


class ReducedOutput(torch.nn.Module):
    """An output layer that computes logits only for ``token_ids`` and gives every other token
    -inf, so the draft's q is exactly zero outside its own output set (decoding stays lossless:
    the target's verification never depends on how the draft picks its candidates). It replaces
    ``lm_head``; every consumer still sees logits over the whole vocabulary."""

    def __init__(self, full: torch.nn.Module, token_ids: torch.Tensor) -> None:
        super().__init__()
        vocab = int(full.weight.shape[0])
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=full.weight.device).unique(sorted=True)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"reduced output vocabulary: token ids must lie in [0, {vocab}), got "
                             f"{ids.numel()} ids in [{int(ids.min()) if ids.numel() else '-'}, "
                             f"{int(ids.max()) if ids.numel() else '-'}]")
        self.out_features = vocab
        self.in_features = int(full.weight.shape[1])
        self.register_buffer("token_ids", ids, persistent=False)
        self.weight = torch.nn.Parameter(full.weight.detach()[ids].clone(), requires_grad=False)
        bias = getattr(full, "bias", None)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach()[ids].clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = torch.nn.functional.linear(hidden, self.weight, self.bias)
        out = sub.new_full((*sub.shape[:-1], self.out_features), float("-inf"))
        return out.index_copy_(-1, self.token_ids, sub)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, scored={self.token_ids.numel()}, out_features={self.out_features}"


def restrict_output_vocab(model, token_ids) -> None:
    """Make ``model`` score only ``token_ids`` (in place): its ``lm_head`` becomes a :class:`ReducedOutput`."""
    layer = model.get_output_embeddings()
    if isinstance(layer, ReducedOutput):
        raise ValueError("the model's output vocabulary is already reduced")
    model.set_output_embeddings(ReducedOutput(layer, token_ids))
    model.config.specdecpp_output_vocab = int(model.get_output_embeddings().token_ids.numel())


def read_output_vocab(path: str | os.PathLike) -> list[int] | None:
    """The token ids of a model directory's reduced output vocabulary file, or None if it has none."""
    f = Path(path) / OUTPUT_VOCAB_FILE
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
        ids = [int(t) for t in data["token_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{f}: not a valid output vocabulary file (needs a 'token_ids' list): {exc}") from exc
    return ids


def write_output_vocab(directory: str | os.PathLike, token_ids, **info) -> Path:
    """Write ``OUTPUT_VOCAB_FILE`` into a model directory: ``load_model`` then reduces the output layer."""
    path = Path(directory) / OUTPUT_VOCAB_FILE
    path.write_text(json.dumps({"size": len(token_ids), **info, "token_ids": [int(t) for t in token_ids]}))
    return path
