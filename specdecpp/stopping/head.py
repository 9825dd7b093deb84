"""Acceptance heads: predict P(candidate accepted | earlier candidates accepted).

Two kinds, saved with their ``kind`` in ``config.json`` and read back by :func:`load_head`:

- ``resnet`` (:class:`AcceptanceHead`, the paper's head, SpecDec++ Section 3.3): scores candidate
  y_k from the draft's final hidden state e_k *at* y_k, which exists only once y_k has been fed
  to the draft. Algorithm 2 therefore judges a candidate one draft step late: every round drafts
  at least two candidates, and the last one is verified unjudged.
- ``next`` (:class:`NextTokenHead`, lag-free): scores y_k from what exists right after y_k is
  sampled: the state e_{k-1} that produced q_k, the token y_k (its input embedding) and q_k's own
  numbers (q_k(y_k), log q_k(y_k), H(q_k)). A round can stop after one candidate, and no draft
  forward is spent on a candidate that is not verified.

Both take one feature vector per candidate in ``forward`` (the hidden state for ``resnet``; the
concatenation of :func:`next_token_features` for ``next``), so train's loss and metrics do not
care which kind they train.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.sampling import entropy_of_log_probs, scored_logits
from ..models.fit import check_draft_fit, config_hidden_size
from ..models.reduced_vocab import ScoredIds

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class ResidualBlock(nn.Module):
    """x + SiLU(Linear(x))."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


HEAD_KINDS = ("resnet", "next")


class AcceptanceHead(nn.Module):
    """(depth + 1)-layer ResNet: ``depth`` distinct residual blocks, then Linear(hidden, 1).

    ``forward(hidden) -> logit``; sigmoid(logit) is the predicted acceptance probability.
    depth 0 is a linear probe. Unlike the authors' code (which repeats one block object), every
    block has its own weights.
    """

    kind = "resnet"
    needs_hidden = True  # scores a candidate from the draft's final hidden state at it
    lag = 1  # candidate y_k is scored once y_{k+1} has been drafted (from the state at y_k)

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

    @property
    def feature_size(self) -> int:
        return self.hidden_size

    def feature_spec(self) -> dict:
        """What a training feature is made of (train's feature cache keys on it)."""
        return {"kind": self.kind}

    needs_position = False  # reads no candidate's position in the response (the lag-free head may)

    def score(self, hidden: torch.Tensor, logits: torch.Tensor, token: torch.Tensor,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """The logit for one candidate at inference: ``hidden`` is the draft's state at the
        candidate (``logits``, ``token`` and ``positions`` are not used by this kind)."""
        return self(hidden.float())

    def attach(self, draft_model) -> None:
        """Check the draft fits and move the head to its device (``SpecDecPP.bind``)."""
        self.check_draft(draft_model)
        self.to(draft_model.device)

    def check_draft(self, draft_model) -> None:
        """Raise a clear error if ``draft_model`` cannot feed this head (its hidden size; the draft's
        name is checked by the apps, which know the configured name: ``specdecpp.models.fit``)."""
        check_draft_fit("acceptance head", "head", self.draft, self.hidden_size, _model_name(draft_model),
                        config_hidden_size(draft_model.config), compare_names=False)

    @property
    def dataset_meta(self) -> dict:
        """What the head's training data recorded (``training.dataset_meta`` of config.json: its
        draft, target, sampling and labels), read by the fit checks; empty if not recorded."""
        return (self.meta.get("training") or {}).get("dataset_meta") or {}

    # -- persistence -----------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike, *, training: dict | None = None,
                        metrics: dict | None = None, **extra: Any) -> Path:
        """Write ``config.json`` (sizes, draft name, training settings, metrics) and ``model.safetensors``.
        Models are recorded by :func:`specdecpp.models.identity.portable_name` (:func:`portable_config`)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"model_type": "specdecpp_acceptance_head", "kind": self.kind, "hidden_size": self.hidden_size,
                  "depth": self.depth, "draft": self.draft, **self._config(), **self.meta, **extra}
        if training is not None:
            config["training"] = training
        if metrics is not None:
            config["metrics"] = metrics
        config = portable_config(config)
        state = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, default=str) + "\n")
        return directory

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, map_location: str | torch.device = "cpu") -> AcceptanceHead:
        """Load a head saved with :meth:`save_pretrained` from a local directory (or a hub repo id).
        A missing or mistyped key of ``config.json``, or a cut or corrupt ``model.safetensors``, is a
        ValueError naming the head, the file and the key or the problem (:func:`read_head_config`)."""
        directory = Path(path)
        if not directory.exists():
            directory = _hub_snapshot(str(path))
        return cls._load(directory, path, read_head_config(directory, path), map_location)

    @classmethod
    def _load(cls, directory: Path, ref, config: dict, map_location) -> AcceptanceHead:
        """The head in ``directory`` (given as ``ref``) from its checked ``config`` (:func:`read_head_config`)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        where = _head_name(ref, directory)
        kind, hidden_size, depth = config["kind"], config["hidden_size"], config["depth"]
        if kind != cls.kind:
            raise ValueError(f"{where} is of kind {kind!r}, not {cls.kind!r} "
                             f"({cls.__name__}): load it with specdecpp.load_head, which returns the right kind")
        cfg_file, weights = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        try:
            kwargs = cls._init_kwargs(config)
            # the random init is overwritten: loading leaves the global RNG as it was
            with torch.random.fork_rng(devices=[]):
                head = cls(hidden_size, depth, draft=config.get("draft"), **kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {cfg_file} does not describe a {cls.kind!r} head ({exc}); "
                             f"{_RESAVE}") from exc
        head.meta = {k: v for k, v in config.items()
                     if k not in ("model_type", "kind", "hidden_size", "depth", "draft", *kwargs)}
        if not weights.is_file():
            raise FileNotFoundError(f"{where} has {CONFIG_NAME} but no {WEIGHTS_NAME} in {directory}; "
                                    f"copy the head's weights there or {_RESAVE}")
        try:
            state = load_file(str(weights), device=str(map_location))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{where}: {weights} ({weights.stat().st_size} bytes) cannot be read as safetensors "
                             f"({type(exc).__name__}: {exc}); the file is cut short or corrupt: copy it again "
                             f"from where the head was saved, or {_RESAVE}") from exc
        shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
        resized = [f"{k} is {tuple(v.shape)}, not {shapes[k]}" for k, v in state.items()
                   if k in shapes and tuple(v.shape) != shapes[k]]
        if resized:  # tensors of other sizes than config.json's give
            raise ValueError(f"{where}: the weights in {weights} do not fit {cfg_file} (hidden_size={hidden_size}, "
                             f"depth={depth}): {'; '.join(resized[:3])}{'; ...' if len(resized) > 3 else ''}; "
                             f"{_RESAVE}")
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{where}: the weights in {weights} do not match {cfg_file} "
                             f"(depth={head.depth}): missing {missing}, unexpected {unexpected}; {_RESAVE}")
        return head.eval()

    def _config(self) -> dict:
        """Kind-specific constructor settings saved in config.json."""
        return {}

    @classmethod
    def _init_kwargs(cls, config: dict) -> dict:
        return {}


# -- the lag-free head ---------------------------------------------------------------------------
NEXT_FEATURES = ("hidden", "embedding", "prob", "logprob", "entropy")  # the default set (today's heads)
# Optional features a head may also ask for (recorded in its config.json ``features``; a head saved
# before they existed has none of them): ``topm`` the ``top_m`` largest probabilities of q_T, sorted
# (the shape of the draft's distribution, beyond its entropy); ``position`` log(1 + i) for the
# candidate's 0-based index i in the response (how far decoding has got; issue 24).
OPTIONAL_FEATURES = ("topm", "position")
ALL_NEXT_FEATURES = NEXT_FEATURES + OPTIONAL_FEATURES
SCALAR_FEATURES = ("prob", "logprob", "entropy")
DEFAULT_TOP_M = 8


def feature_width(name: str, hidden_size: int, top_m: int = DEFAULT_TOP_M) -> int:
    """How many numbers feature ``name`` adds to the lag-free head's input."""
    if name in ("hidden", "embedding"):
        return hidden_size
    return top_m if name == "topm" else 1


def next_token_features(hidden: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, embedding,
                        temperature: float, features=NEXT_FEATURES, top_m: int = DEFAULT_TOP_M,
                        positions: torch.Tensor | None = None, support: torch.Tensor | None = None) -> torch.Tensor:
    """The lag-free head's input for candidates y drafted from the draft states ``hidden`` [..., H]
    (the states that produced q) with raw logits ``logits`` [..., V]; ``tokens`` [...] are the
    sampled candidates, ``embedding`` the draft's input embedding module.

    In the order of ``features``: ``hidden`` e_{k-1}; ``embedding`` the input embedding of y_k;
    ``prob`` / ``logprob`` q_T(y_k) and its log, ``entropy`` H(q_T), ``topm`` the ``top_m`` largest
    probabilities of q_T in decreasing order, ``position`` log(1 + i) for each candidate's 0-based
    index i in the response (``positions`` [...], needed only by this feature), where q_T = softmax(logits / T)
    over the whole vocabulary (T = ``temperature``, 1 under greedy decoding, as SVIP's entropy; a
    reduced output vocabulary's -inf logits add nothing). One function for train and inference, so
    the engine hands the head exactly the features it was trained on. ``support``: the only token
    ids whose logits may be finite (a reduced output vocabulary,
    :func:`specdecpp.models.reduced_vocab.scored_ids`): the softmax's statistics are then computed over
    those logits alone, the same numbers, faster."""
    t = temperature if temperature > 0 else 1.0
    scored = scored_logits(logits, support).float()
    scored = scored if t == 1.0 else scored / t
    logp = torch.log_softmax(scored, dim=-1)  # log q_T of the scored tokens
    parts, chosen = [], None
    for name in features:
        if name == "hidden":
            parts.append(hidden.float())
        elif name == "embedding":
            parts.append(embedding(tokens.to(embedding.weight.device)).float().to(hidden.device))
        elif name in ("prob", "logprob"):
            if chosen is None:  # log q_T(y) = z_y / T - log Z (-inf for a token outside the support), where
                # log Z = max z / T - max log q_T (the largest logit has the largest log-probability)
                z_y = logits.gather(-1, tokens.to(logits.device).unsqueeze(-1)).float()
                log_z = scored.amax(-1, keepdim=True) - logp.amax(-1, keepdim=True)
                chosen = (z_y if t == 1.0 else z_y / t) - log_z
            parts.append(chosen.exp() if name == "prob" else chosen.clamp_min(-50.0))
        elif name == "entropy":
            parts.append(entropy_of_log_probs(logp).unsqueeze(-1))
        elif name == "topm":
            parts.append(logp.topk(top_m, dim=-1).values.exp())
        elif name == "position":
            if positions is None:
                raise ValueError("the lag-free head's `position` feature needs each candidate's index in the "
                                 "response (positions), and none was given")
            positions = torch.as_tensor(positions, device=hidden.device)
            if positions.shape != tokens.shape:
                raise ValueError(f"positions {tuple(positions.shape)} must have the candidates' shape "
                                 f"{tuple(tokens.shape)}")
            parts.append(torch.log1p(positions.float()).unsqueeze(-1))
        else:
            raise ValueError(f"unknown lag-free head feature {name!r}; choose from {list(ALL_NEXT_FEATURES)}")
    return torch.cat(parts, dim=-1)


class NextTokenHead(AcceptanceHead):
    """The lag-free head (kind ``next``): P(y_k accepted) from the features of
    :func:`next_token_features`, available right after y_k is sampled.

    Concatenated features -> Linear(F, hidden) -> ``depth`` residual blocks -> Linear(hidden, 1);
    depth 0 is a linear probe on the features. The token embedding is read from the draft the
    head is attached to (``attach``), never stored in the head, so a head stays a few MB.
    """

    kind = "next"
    lag = 0

    def __init__(self, hidden_size: int, depth: int = 3, draft: str | None = None,
                 features=NEXT_FEATURES, temperature: float = 1.0, top_m: int = DEFAULT_TOP_M) -> None:
        super().__init__(hidden_size, depth, draft)
        features = tuple(features)
        unknown = [f for f in features if f not in ALL_NEXT_FEATURES]
        if not features or unknown or len(set(features)) != len(features):
            raise ValueError(f"NextTokenHead: features must be distinct names from {list(ALL_NEXT_FEATURES)}, "
                             f"got {list(features)}")
        if isinstance(top_m, bool) or not isinstance(top_m, int) or top_m < 1:
            raise ValueError(f"NextTokenHead: top_m must be an integer >= 1, got {top_m!r}")
        self.features = features
        self.temperature = float(temperature)
        self.top_m = top_m
        size = sum(feature_width(f, hidden_size, top_m) for f in features)
        self.in_size = size
        self.proj = nn.Linear(size, hidden_size) if depth > 0 else None
        self.out = nn.Linear(hidden_size if depth > 0 else size, 1)
        self.__dict__["_embedding"] = None  # the draft's, set by attach(); not a parameter of the head
        self.__dict__["_support"] = ScoredIds()  # the draft's scored token ids where its output vocabulary is reduced

    @property
    def feature_size(self) -> int:
        return self.in_size

    def feature_spec(self) -> dict:
        """Also train's feature-cache key: ``top_m`` enters only for a head that uses ``topm``, so
        the caches (and configs) of today's feature sets stay as they were."""
        spec = {"kind": self.kind, "features": list(self.features), "temperature": self.temperature}
        if "topm" in self.features:
            spec["top_m"] = self.top_m
        return spec

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if features.shape[-1] != self.in_size:
            raise ValueError(f"NextTokenHead expects {self.in_size} features ({'+'.join(self.features)} for "
                             f"hidden_size {self.hidden_size}), got {features.shape[-1]}: the head was trained "
                             "for another draft model or feature set")
        x = features.to(self.out.weight.dtype)
        if self.proj is not None:
            x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)

    @property
    def needs_position(self) -> bool:
        """The head reads each candidate's index in the response (the ``position`` feature)."""
        return "position" in self.features

    def features_of(self, hidden, logits, tokens, embedding=None, temperature: float | None = None,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
        embedding = embedding if embedding is not None else self.__dict__["_embedding"]
        if embedding is None and "embedding" in self.features:
            raise RuntimeError("NextTokenHead needs the draft's token embedding: call head.attach(draft) first")
        return next_token_features(hidden, logits, tokens, embedding,
                                   self.temperature if temperature is None else temperature, self.features,
                                   self.top_m, positions, self.__dict__["_support"](logits))

    def score(self, hidden: torch.Tensor, logits: torch.Tensor, token: torch.Tensor,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """The logit for candidate y_k: ``hidden`` e_{k-1}, ``logits`` the raw logits of q_k,
        ``positions`` y_k's index in the response (read only by the ``position`` feature)."""
        return self(self.features_of(hidden, logits, token, positions=positions))

    def attach(self, draft_model) -> None:
        super().attach(draft_model)
        self.__dict__["_embedding"] = draft_model.get_input_embeddings()
        self.__dict__["_support"] = ScoredIds(draft_model)  # a reduced output vocabulary: its logits alone

    def _config(self) -> dict:
        return {k: v for k, v in self.feature_spec().items() if k != "kind"}

    @classmethod
    def _init_kwargs(cls, config: dict) -> dict:
        kwargs = {"features": tuple(config.get("features", NEXT_FEATURES)),
                  "temperature": float(config.get("temperature", 1.0))}
        if "top_m" in config:
            kwargs["top_m"] = int(config["top_m"])
        return kwargs


def portable_config(config: dict) -> dict:
    """A head config whose model fields (``draft``, ``target`` and the training dataset's
    ``dataset_meta.draft`` / ``.target``) name models portably: a stamped directory by its identity
    (``name@digest``), a hub id as it is (:func:`specdecpp.models.identity.portable_name`)."""
    from ..models.identity import portable_name

    config = {**config}
    for key in ("draft", "target"):
        if config.get(key) is not None:
            config[key] = portable_name(config[key])
    meta = (config.get("training") or {}).get("dataset_meta")
    if isinstance(meta, dict):
        meta = {**meta, **{k: portable_name(meta[k]) for k in ("draft", "target") if meta.get(k) is not None}}
        config["training"] = {**config["training"], "dataset_meta": meta}
    return config


def head_class(kind: str) -> type[AcceptanceHead]:
    if kind not in HEAD_KINDS:
        raise ValueError(f"head kind must be one of {list(HEAD_KINDS)}, got {kind!r}")
    return AcceptanceHead if kind == "resnet" else NextTokenHead


def build_head(kind: str, hidden_size: int, depth: int, draft: str | None = None, **kwargs) -> AcceptanceHead:
    """A new head of ``kind`` (``resnet``: the paper's; ``next``: lag-free, takes ``features`` and
    ``temperature``)."""
    return head_class(kind)(hidden_size, depth, draft=draft, **kwargs)


_RESAVE = "re-save the head with save_pretrained, or train it again (python -m train +experiment=...)"


def _head_name(ref, directory: Path) -> str:
    """How errors name a head: as it was given, and where a hub id was fetched to."""
    return f"acceptance head {str(ref)!r}" + (f" (fetched to {directory})" if Path(ref) != directory else "")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_head_config(directory: str | os.PathLike, ref: str | os.PathLike | None = None) -> dict:
    """A saved head's ``config.json``, checked: valid JSON, an object, ``hidden_size`` a positive
    integer, ``depth`` an integer >= 0 and ``kind`` one of :data:`HEAD_KINDS` (absent: ``resnet``, the
    heads saved before head kinds existed). The one reader of a head's config (``from_pretrained``,
    ``load_head``, ``head_kind``): every problem is a ValueError naming the head (``ref``, as the user
    gave it), the file and the key. Returns the config with ``kind`` filled in."""
    directory = Path(directory)
    where = _head_name(directory if ref is None else ref, directory)
    cfg_file = directory / CONFIG_NAME
    if directory.is_file():
        raise FileNotFoundError(f"{where} is a file, not a head directory (one holding {CONFIG_NAME} and "
                                f"{WEIGHTS_NAME}); pass the directory the head was saved to")
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{where} has no {CONFIG_NAME} in {directory}: a head directory holds "
                                f"{CONFIG_NAME} and {WEIGHTS_NAME}; {_RESAVE}")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: {cfg_file} is not valid JSON ({exc}); {_RESAVE}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {cfg_file} holds a JSON {type(config).__name__}, not an object with "
                         f"hidden_size, depth and kind; {_RESAVE}")
    if config.get("model_type") not in (None, "specdecpp_acceptance_head"):
        raise ValueError(f"{where}: {cfg_file} is not an acceptance head config "
                         f"(model_type={config.get('model_type')!r}); pass the directory train saved the head to")
    config = {**config, "kind": config.get("kind", "resnet")}
    for key, ok, want in (("hidden_size", lambda v: _is_int(v) and v > 0, "a positive integer"),
                          ("depth", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
                          ("kind", lambda v: v in HEAD_KINDS, f"one of {list(HEAD_KINDS)}")):
        if key not in config:
            raise ValueError(f"{where}: {cfg_file} has no {key!r} (a head's config records hidden_size, depth "
                             f"and kind); add it, or {_RESAVE}")
        if not ok(config[key]):
            raise ValueError(f"{where}: {cfg_file} has {key!r}: {json.dumps(config[key])}, which must be {want}; "
                             f"fix it, or {_RESAVE}")
    return config


def head_kind(path: str | os.PathLike) -> str:
    """The kind recorded in a saved head's config.json (``resnet`` when none is recorded)."""
    return read_head_config(path)["kind"]


def load_head(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> AcceptanceHead:
    """Load a saved head of either kind (its ``config.json`` says which): the one loader that
    ``python -m infer``, ``infer.potential`` and ``specdecpp.hf.generate`` go through."""
    directory = Path(path)
    if not directory.exists():
        directory = _hub_snapshot(str(path))
    config = read_head_config(directory, path)
    return head_class(config["kind"])._load(directory, path, config, map_location)


def _model_name(model) -> str:
    return getattr(model.config, "_name_or_path", None) or type(model).__name__


def _hub_snapshot(repo_id: str) -> Path:
    """A head that is not a local directory: ``repo_id`` ("org/name") fetched into huggingface_hub's
    cache (its cache, token and ``HF_HUB_OFFLINE`` apply). A reference that cannot be a hub id is a
    missing local path, and the hub is not asked."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    hint = "train one with `python -m train +experiment=wrej6_d3` or pass the directory it was saved to"
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise FileNotFoundError(f"acceptance head path {repo_id!r} does not exist (and is no hub id 'org/name'); "
                                f"{hint}") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME]))
    except Exception as exc:  # offline, unknown repo, no access
        raise FileNotFoundError(
            f"acceptance head path {repo_id!r} does not exist locally and could not be fetched from the Hugging "
            f"Face hub ({type(exc).__name__}: {exc}); {hint}") from exc
