"""The acceptance head: predicts P(candidate accepted | earlier candidates accepted) from the
draft's final hidden state at that candidate (SpecDec++ Section 3.3)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class ResidualBlock(nn.Module):
    """x + SiLU(Linear(x))."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(nn.Module):
    """(depth + 1)-layer ResNet: ``depth`` distinct residual blocks, then Linear(hidden, 1).

    ``forward(hidden) -> logit``; sigmoid(logit) is the predicted acceptance probability.
    depth 0 is a linear probe. Unlike the authors' code (which repeats one block object), every
    block has its own weights.
    """

    needs_hidden = True  # scores a candidate from the draft's final hidden state at it

    def __init__(self, hidden_size: int, depth: int = 3, draft: str | None = None) -> None:
        super().__init__()
        if not (isinstance(hidden_size, int) and hidden_size > 0):
            raise ValueError(f"AcceptanceHead: hidden_size must be a positive integer, got {hidden_size!r}")
        if not (isinstance(depth, int) and depth >= 0):
            raise ValueError(f"AcceptanceHead: depth must be an integer >= 0, got {depth!r}")
        self.hidden_size = hidden_size
        self.depth = depth
        self.draft = draft
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(depth))
        self.out = nn.Linear(hidden_size, 1)
        self.meta: dict[str, Any] = {}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"AcceptanceHead expects hidden states of size {self.hidden_size}, "
                             f"got {hidden.shape[-1]}: the head was trained for another draft model")
        x = hidden.to(self.out.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)

    def check_draft(self, draft_model) -> None:
        """Raise a clear error if ``draft_model`` cannot feed this head."""
        size = getattr(draft_model.config, "hidden_size", None)
        if size != self.hidden_size:
            raise ValueError(
                f"acceptance head has hidden_size {self.hidden_size} (trained on draft "
                f"{self.draft or 'unknown'!r}) but the draft model {_model_name(draft_model)!r} has "
                f"hidden_size {size}: train a head for this draft (python -m train) or load the matching draft")

    # -- persistence -----------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike, *, training: dict | None = None,
                        metrics: dict | None = None, **extra: Any) -> Path:
        """Write ``config.json`` (sizes, draft name, training settings, metrics) and ``model.safetensors``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"model_type": "specdecpp_acceptance_head", "hidden_size": self.hidden_size,
                  "depth": self.depth, "draft": self.draft, **self.meta, **extra}
        if training is not None:
            config["training"] = training
        if metrics is not None:
            config["metrics"] = metrics
        state = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, default=str) + "\n")
        return directory

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, map_location: str | torch.device = "cpu") -> AcceptanceHead:
        """Load a head saved with :meth:`save_pretrained` from a local directory (or a hub repo id)."""
        from safetensors.torch import load_file

        directory = Path(path)
        if not directory.exists():
            directory = _hub_snapshot(str(path))
        cfg_file, weights = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        if not cfg_file.is_file() or not weights.is_file():
            raise FileNotFoundError(f"acceptance head {str(path)!r} must contain {CONFIG_NAME} and {WEIGHTS_NAME}")
        config = json.loads(cfg_file.read_text())
        if config.get("model_type") not in (None, "specdecpp_acceptance_head"):
            raise ValueError(f"{cfg_file} is not an acceptance head config (model_type={config.get('model_type')!r})")
        head = cls(int(config["hidden_size"]), int(config["depth"]), draft=config.get("draft"))
        head.meta = {k: v for k, v in config.items()
                     if k not in ("model_type", "hidden_size", "depth", "draft")}
        state = load_file(str(weights), device=str(map_location))
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"acceptance head weights in {weights} do not match config "
                             f"(depth={head.depth}): missing {missing}, unexpected {unexpected}")
        return head.eval()


def _model_name(model) -> str:
    return getattr(model.config, "_name_or_path", None) or type(model).__name__


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME]))
    except Exception as exc:  # offline, unknown repo, bad id
        raise FileNotFoundError(
            f"acceptance head path {repo_id!r} does not exist locally and could not be fetched "
            f"from the Hugging Face hub ({type(exc).__name__}); train one with "
            f"`python -m train +experiment=wrej6_d3` or pass the directory it was saved to") from exc
