"""The demo draft's one definition: Llama layers between embeddings ``E @ P_in`` and an output layer
``E @ P_out`` (``E`` the target's embedding matrix, frozen; ``P_in``, ``P_out`` learned
[target width, draft width] projections). specdecpp_demo/build_draft.py trains it; the shipped
artifact (``artifact/``) holds only its layers and projections; :meth:`ProjectedDraft.to_causal_lm`
turns it into the plain ``LlamaForCausalLM`` the rest of the pipeline loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifact"  # package data: the shipped draft
ARTIFACT_WEIGHTS = "draft_layers.safetensors"
ARTIFACT_CONFIG = "draft_config.json"
ARTIFACT_VOCAB = "output_vocab.json"  # optional: the draft's reduced output vocabulary
INPUT_PROJECTION = "input_projection"
OUTPUT_PROJECTION = "output_projection"


class ProjectedDraft(torch.nn.Module):
    """Llama layers between embeddings E @ P_in and an output layer E @ P_out (E frozen)."""

    def __init__(self, llama_config: dict, target_embeddings: torch.Tensor,
                 input_projection: torch.Tensor, output_projection: torch.Tensor) -> None:
        from transformers import LlamaConfig, LlamaModel

        super().__init__()
        width = target_embeddings.shape[1]
        for name, proj in (("input", input_projection), ("output", output_projection)):
            if proj.shape[0] != width:
                raise ValueError(f"draft {name} projection maps {proj.shape[0]} dims but the target's "
                                 f"embeddings have {width}: the draft was built for another target")
        self.llama_config = dict(llama_config)
        self.body = LlamaModel(LlamaConfig.from_dict({**llama_config, "vocab_size": 1, "pad_token_id": None,
                                                      "bos_token_id": None, "eos_token_id": None}))
        self.register_buffer("target_embeddings", target_embeddings, persistent=False)
        self.input_projection = torch.nn.Parameter(input_projection.clone())
        self.output_projection = torch.nn.Parameter(output_projection.clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, T, d]; logits are ``hidden @ output_matrix().T``."""
        x = F.embedding(ids, self.target_embeddings) @ self.input_projection
        return self.body(inputs_embeds=x).last_hidden_state

    def output_matrix(self, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Output-layer rows [V, d], or only those of ``token_ids``."""
        rows = self.target_embeddings if token_ids is None else self.target_embeddings[token_ids]
        return rows @ self.output_projection

    # -- the shipped artifact: layers (float16) and projections (float32) ----------------------
    def artifact_tensors(self) -> dict[str, torch.Tensor]:
        layers = {f"model.{k}": v.detach().to(torch.float16).contiguous()
                  for k, v in self.body.state_dict().items() if not k.startswith("embed_tokens")}
        return {**layers, INPUT_PROJECTION: self.input_projection.detach().float().contiguous(),
                OUTPUT_PROJECTION: self.output_projection.detach().float().contiguous()}

    @classmethod
    def from_artifact_tensors(cls, llama_config: dict, tensors: dict[str, torch.Tensor],
                              target_embeddings: torch.Tensor, where: str = "the artifact") -> ProjectedDraft:
        """The draft whose :meth:`artifact_tensors` are ``tensors`` (float32 from here on)."""
        tensors = dict(tensors)
        missing = [k for k in (INPUT_PROJECTION, OUTPUT_PROJECTION) if k not in tensors]
        if missing:
            raise ValueError(f"demo draft {where} has no {missing}: not a draft artifact")
        projections = [tensors.pop(k).float() for k in (INPUT_PROJECTION, OUTPUT_PROJECTION)]
        draft = cls(llama_config, target_embeddings.float(), *projections)
        body = {k.removeprefix("model."): v.float() for k, v in tensors.items()}
        missing, unexpected = draft.body.load_state_dict(body, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens")]
        if missing or unexpected:
            raise ValueError(f"demo draft {where} does not match its config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        return draft

    def to_causal_lm(self):
        """The same model as a plain ``LlamaForCausalLM`` (untied embeddings E @ P_in, E @ P_out)."""
        from transformers import LlamaConfig, LlamaForCausalLM

        vocab = self.target_embeddings.shape[0]
        config = LlamaConfig.from_dict({**self.llama_config, "vocab_size": vocab,
                                        "hidden_size": self.input_projection.shape[1], "tie_word_embeddings": False})
        model = LlamaForCausalLM(config)
        missing, unexpected = model.model.load_state_dict(
            {k: v for k, v in self.body.state_dict().items() if not k.startswith("embed_tokens")}, strict=False)
        if unexpected or [k for k in missing if not k.startswith("embed_tokens")]:
            raise ValueError(f"draft layers do not fit a LlamaForCausalLM: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(self.target_embeddings.float() @ self.input_projection.float())
            model.lm_head.weight.copy_(self.output_matrix().float())
        return model


def draft_config(artifact: Path = ARTIFACT_DIR) -> dict:
    """The artifact's ``draft_config.json`` (Llama config, recipe, training record)."""
    path = Path(artifact) / ARTIFACT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"demo draft artifact {str(path)!r} not found: rebuild it with "
                                "python -m specdecpp_demo.build_draft, or reinstall specdecpp "
                                "(the artifact is package data "
                                "of specdecpp_demo)")
    return json.loads(path.read_text())


def load_artifact(target_embeddings: torch.Tensor, artifact: Path = ARTIFACT_DIR) -> ProjectedDraft:
    """The shipped draft (float32) over the target's embedding matrix."""
    from safetensors.torch import load_file

    cfg = draft_config(artifact)
    tensors = load_file(str(Path(artifact) / ARTIFACT_WEIGHTS))
    return ProjectedDraft.from_artifact_tensors(cfg["llama_config"], tensors, target_embeddings, repr(str(artifact)))
