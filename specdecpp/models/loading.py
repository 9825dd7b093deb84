"""Loading a draft/target pair: hub ids, local HF directories, GGUF files or portable identities
(resolved through :mod:`specdecpp.models.identity`); devices and precisions; one tokenizer for both, and
the end-of-sequence ids every stage stops on."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from .feature_draft import FeatureDraft, is_feature_draft
from .identity import resolve_model
from .reduced_vocab import output_vocab_size, read_output_vocab, restrict_output_vocab

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available on this machine")
    return dev


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX-BF16), where
    oneDNN's bf16 GEMM is fast: a bf16 forward then reads half the bytes of a float32 one, and
    scoring 2-8 tokens costs about what one token does (measured in the docs, "Precision")."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how metas, rows and cache keys record a precision
    (the name :func:`resolve_dtype` takes back)."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, float32 on CPU. ``fast``: bfloat16 on CUDA and on CPUs with
    native bf16 matrix instructions (:func:`cpu_has_native_bf16`), float32 on other CPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    cuda = device is not None and device.type == "cuda"
    if dtype == "auto":
        return torch.bfloat16 if cuda else torch.float32
    if dtype == "fast":
        return torch.bfloat16 if cuda or cpu_has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, fast, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def _source(path: str) -> tuple[str, dict]:
    """Map a model reference to from_pretrained arguments; raise if it cannot be a model. A portable
    identity (``name@digest``, :mod:`specdecpp.models.identity`) is first resolved to a local directory."""
    p = Path(os.path.expanduser(resolve_model(str(path))))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"model path {str(path)!r}: GGUF file not found")
        return str(p.parent), {"gguf_file": p.name}
    if p.exists():
        if p.is_dir() and not (p / "config.json").is_file():
            raise FileNotFoundError(f"model path {str(path)!r} is a directory without config.json; "
                                    "pass a Hugging Face model directory, a .gguf file or a hub id")
        return str(p), {}
    if str(path).startswith((".", "/", "~")) or not _HUB_ID.match(str(path)):
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (and is not a hub id)")
    return str(path), {}


def load_config(path: str):
    """The model's transformers config alone (no weights): for checks before anything loads. A
    feature draft's (speculators format) is its decoder layer's LlamaConfig, as
    :attr:`FeatureDraft.config <specdecpp.models.feature_draft.FeatureDraft>` is."""
    from transformers import AutoConfig

    src, kw = _source(path)
    if not kw and is_feature_draft(src):
        from transformers import LlamaConfig

        from .feature_draft import _llama_kwargs, read_config

        config = LlamaConfig(**_llama_kwargs(read_config(Path(src))["transformer_layer_config"]))
        config._name_or_path = str(path)
        return config
    try:
        return AutoConfig.from_pretrained(src, **kw)
    except OSError as exc:
        raise FileNotFoundError(f"could not read the config of model {str(path)!r}: {exc}") from exc


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    src, kw = _source(path)
    try:
        return AutoTokenizer.from_pretrained(src, **kw)
    except OSError as exc:
        raise FileNotFoundError(f"could not load a tokenizer for {str(path)!r}: a local path that does "
                                f"not exist, or a hub id that is unreachable offline ({exc})") from exc


def load_model(path: str, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto"):
    """Load one causal LM, frozen and in eval mode."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    src, kw = _source(path)
    if not kw and is_feature_draft(src):
        raise ValueError(f"{str(path)!r} is a feature draft (speculators format): it loads with its target, "
                         "load_pair(draft, target) or FeatureDraft.from_pretrained(directory, target=...)")
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=resolve_dtype(dtype, dev), **kw)
    except OSError as exc:
        raise FileNotFoundError(f"could not load model {str(path)!r}: a local path that does not "
                                f"exist, or a hub id that is unreachable offline ({exc})") from exc
    model.to(dev).eval().requires_grad_(False)
    model.config._name_or_path = str(path)
    if not kw and Path(src).is_dir():
        ids = read_output_vocab(src)
        if ids is not None:
            restrict_output_vocab(model, ids)
    return model


def token_set(ids) -> set[int]:
    """``None`` | an id | ids -> a set of ids (how every stage normalises EOS arguments)."""
    if ids is None:
        return set()
    if isinstance(ids, int) or (isinstance(ids, torch.Tensor) and ids.dim() == 0):
        return {int(ids)}
    return {int(t) for t in ids}


def eos_token_ids(tokenizer=None, *models) -> set[int]:
    """The end-of-sequence ids for generation: the tokenizer's EOS and every EOS id of the
    models' generation configs (chat models often list several, e.g. <|eot_id|> and
    <|end_of_text|>). data_gen, infer and every runner stop on this one set."""
    ids = token_set(getattr(tokenizer, "eos_token_id", None))
    for model in models:
        ids |= token_set(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    return ids


def check_tokenizers(draft_tok, target_tok, draft_name: str = "draft", target_name: str = "target") -> None:
    """Refuse a pair whose tokenizers disagree (size and token-to-id maps)."""
    if len(draft_tok) != len(target_tok):
        raise ValueError(f"tokenizer mismatch: draft {draft_name!r} has {len(draft_tok)} tokens, "
                         f"target {target_name!r} has {len(target_tok)}; speculative decoding needs one vocabulary")
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    if dv != tv:
        diff = sorted(set(dv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:5]
        raise ValueError(f"tokenizer mismatch between draft {draft_name!r} and target {target_name!r}: "
                         f"token-to-id maps differ, e.g. {diff}")


def check_vocab(model, tokenizer, name: str) -> None:
    """The model must score every token of the tokenizer (a larger, padded embedding is fine)."""
    size = output_vocab_size(model)
    if size < len(tokenizer):
        raise ValueError(f"model {name!r} scores {size} tokens but the tokenizer has {len(tokenizer)}: "
                         "vocabularies disagree")


def load_pair(draft: str, target: str, device: str | torch.device = "auto",
              dtype: str | torch.dtype = "auto"):
    """Load ``(draft_model, target_model, tokenizer)``.

    Each of ``draft`` and ``target`` is a hub id, a local HF directory or a ``.gguf`` file.
    The two tokenizers must agree (vocabulary size and token-to-id map); a model whose output
    layer is padded beyond the tokenizer is fine (the engine scores the shared vocabulary only).
    A ``draft`` directory in the speculators format (config.json with ``speculators_model_type``)
    loads as a :class:`~specdecpp.models.feature_draft.FeatureDraft` for the target (checked
    against it, on its device and in its dtype), with the target's tokenizer.
    """
    for name, ref in (("draft", draft), ("target", target)):
        if not ref:
            raise ValueError(f"load_pair: no {name} model given")
        _source(ref)  # fail on a missing path before loading anything
    feature = is_feature_draft(resolve_model(str(draft)))
    target_tok = load_tokenizer(target)
    if not feature:
        check_tokenizers(load_tokenizer(draft), target_tok, draft, target)
    dev = resolve_device(device)
    draft_model = None if feature else load_model(draft, dev, dtype)
    target_model = load_model(target, dev, dtype)
    if feature:
        draft_model = FeatureDraft.from_pretrained(resolve_model(str(draft)), target=target_model)
        draft_model.name_or_path = str(draft)
    else:
        check_vocab(draft_model, target_tok, draft)
    check_vocab(target_model, target_tok, target)
    return draft_model, target_model, target_tok
