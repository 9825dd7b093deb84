"""Loading a draft/target pair: hub ids, local HF directories or GGUF files; one tokenizer."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

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
    scoring 2-8 tokens costs about what one token does (docs/demo.md, "Precision")."""
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
    """Map a model reference to from_pretrained arguments; raise if it cannot be a model."""
    p = Path(os.path.expanduser(str(path)))
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


MODEL_ID_FILE = "specdecpp_demo.json"  # a materialised model's stamp; its artifact digest names the model


def model_identity(ref: str) -> str | None:
    """A location-independent name for a materialised model directory (the demo draft:
    ``specdecpp-demo-draft@<artifact sha256>``), or None. Lets a shipped head name its draft
    without naming the machine's cache path."""
    stamp = Path(os.path.expanduser(str(ref))) / MODEL_ID_FILE
    if not stamp.is_file():
        return None
    try:
        import json

        digest = json.loads(stamp.read_text()).get("artifact_sha256")
    except ValueError:
        return None
    return f"specdecpp-demo-draft@{digest}" if digest else None


def same_model(a: str, b: str) -> bool:
    """Whether two model references name the same model: local paths compared resolved (a symlink,
    ``~`` or a trailing slash names the same directory), a materialised directory against its
    identity (:func:`model_identity`), other references (hub ids) as text."""
    pa, pb = Path(os.path.expanduser(str(a))), Path(os.path.expanduser(str(b)))
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    for x, y in ((a, b), (b, a)):
        ident = model_identity(x)
        if ident is not None and ident == str(y):
            return True
    return str(a).rstrip("/") == str(b).rstrip("/")


def load_config(path: str):
    """The model's transformers config alone (no weights): for checks before anything loads."""
    from transformers import AutoConfig

    src, kw = _source(path)
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


def new_cache(model):
    """An empty KV cache for ``model`` (transformers' DynamicCache)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)  # transformers >= 4.56 (pyproject.toml)


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


def keep_last(total: int, k: int, device) -> int | torch.Tensor:
    """``logits_to_keep`` for the last ``k`` of ``total`` positions of a batch-1 forward.

    transformers slices the final hidden state as ``hidden[:, -k:, :]``; for one row that is a
    [1, k, H] view whose batch stride is total * H, which PyTorch calls contiguous but oneDNN's
    bf16 GEMM on CPU does not take its fast path for: the demo target's output layer then costs
    ~70 ms instead of ~3 ms (the whole bf16 forward over 4 tokens 94 ms instead of 29 ms). An
    index tensor makes transformers gather the rows into a fresh tensor instead. Keeping every
    position (k >= total) stays the plain int (no slice is taken)."""
    if k >= total:
        return k
    return torch.arange(total - k, total, device=device)


class GatherKeptLogits:
    """While active, an integer ``logits_to_keep`` that any of ``models`` receives from code we do
    not control (transformers' own ``generate``, e.g. assisted generation's draft calls, which feed
    2-3 new tokens and keep 1 logit) is replaced by :func:`keep_last`'s index tensor: the same rows,
    gathered instead of sliced, so oneDNN's bf16 fast path applies. ``with GatherKeptLogits(draft,
    target): target.generate(...)``; the hooks are removed on exit."""

    def __init__(self, *models) -> None:
        self.models = models
        self.handles: list = []

    @staticmethod
    def _hook(module, args, kwargs):
        k = kwargs.get("logits_to_keep")
        if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        ref = ids if ids is not None else kwargs.get("inputs_embeds")
        if ref is None or ref.shape[0] != 1:
            return None
        return args, {**kwargs, "logits_to_keep": keep_last(ref.shape[1], k, ref.device)}

    def __enter__(self) -> GatherKeptLogits:
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self.models]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class FinalHidden:
    """Captures a causal LM's final hidden state (after the final norm) through a forward hook on
    its decoder, so the model runs without ``output_hidden_states`` (which keeps every layer's
    states). ``with FinalHidden(model) as h: model(...); h.value`` -> [B, L, H]. A model without a
    ``get_decoder()`` falls back to ``output_hidden_states`` (``h.kwargs`` says which to pass)."""

    def __init__(self, model) -> None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        self.decoder = decoder if isinstance(decoder, torch.nn.Module) and decoder is not model else None
        self.kwargs = {} if self.decoder is not None else {"output_hidden_states": True}
        self.value: torch.Tensor | None = None
        self._handle = None

    def _hook(self, module, args, output) -> None:
        self.value = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def take(self, out) -> torch.Tensor:
        """The final hidden state of the forward that returned ``out``."""
        return out.hidden_states[-1] if self.decoder is None else self.value

    def __enter__(self) -> FinalHidden:
        if self.decoder is not None:
            self._handle = self.decoder.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.value = None


def output_vocab_size(model) -> int:
    """Tokens the model scores (a reduced output layer still scores the whole vocabulary)."""
    layer = model.get_output_embeddings()
    return int(getattr(layer, "out_features", None) or layer.weight.shape[0])


# -- reduced output vocabularies -------------------------------------------------------------------
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
    import json

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
    import json

    path = Path(directory) / OUTPUT_VOCAB_FILE
    path.write_text(json.dumps({"size": len(token_ids), **info, "token_ids": [int(t) for t in token_ids]}))
    return path


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
    """
    for name, ref in (("draft", draft), ("target", target)):
        if not ref:
            raise ValueError(f"load_pair: no {name} model given")
        _source(ref)  # fail on a missing path before loading anything
    draft_tok, target_tok = load_tokenizer(draft), load_tokenizer(target)
    check_tokenizers(draft_tok, target_tok, draft, target)
    dev = resolve_device(device)
    draft_model = load_model(draft, dev, dtype)
    target_model = load_model(target, dev, dtype)
    check_vocab(draft_model, target_tok, draft)
    check_vocab(target_model, target_tok, target)
    return draft_model, target_model, target_tok
