"""What ``vllm.LLM(speculative_config=...)`` and ``vllm serve --speculative-config`` take, built
from the library's stop policies (docs/vllm.md).

vLLM's ``SpeculativeConfig`` forbids keys it does not know, so the stop policy travels in the
draft's directory: :func:`speculative_config` writes a *policy bundle*, a directory holding links
to every file of the draft, ``specdecpp_stop_policy.json`` (the policy's name and settings) and,
for a head, the head's own files. vLLM loads the draft from the bundle as from any local model
directory; the proposer of :mod:`specdecpp.vllm.internals` (registered in every vLLM process by
the ``vllm.general_plugins`` entry point) finds the policy file beside it and stops each request's
draft by it. Without that file the proposer is vLLM's own ``draft_model``. A feature draft (EAGLE-3,
speculators format) is sent as vLLM's ``eagle3`` method, the same bundle read by the same subclass of
vLLM's EAGLE proposer.

Everything is checked here, before vLLM starts: the installed vLLM's version, the policy, the
draft, and a head against the draft (``specdecpp.models.fit``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..models.feature_draft import is_feature_draft
from ..models.fit import check_draft_fit, check_sampling_fit
from ..stopping.head import AcceptanceHead, load_head
from ..stopping.policies import SVIP, FixedK, SpecDecPP, StopPolicy, TargetOnly, check_count, check_policy_keywords
from .acceptance import OnlineAcceptance
from .load_aware import DRAFT_MODES, StepCosts
from .version import check_version

POLICY_FILE = "specdecpp_stop_policy.json"
HEAD_DIR = "specdecpp_head"
FORMAT = 1
# The policies a bundle can name, by their ``name``; each is rebuilt from its settings (``policy_spec``).
POLICIES = {"fixed_k": FixedK, "svip": SVIP, "specdecpp": SpecDecPP, "online_acceptance": OnlineAcceptance}
SPECDECPP_KEYS = ("threshold", "min_candidates", "max_candidates")
# Keys of vLLM's speculative config this module sets itself.
OWNED_KEYS = ("method", "model", "num_speculative_tokens")


def default_cache_dir() -> Path:
    """Where bundles go: ``$SPECDECPP_CACHE/vllm`` (the project's cache), else ``specdecpp/vllm`` in the home cache."""
    root = os.environ.get("SPECDECPP_CACHE")
    return Path(root).expanduser() / "vllm" if root else Path.home() / ".cache" / "specdecpp" / "vllm"


def policy_by_name(name: str) -> type[StopPolicy]:
    """The policy class of a bundle's or a caller's ``name``; a ValueError naming the choices otherwise."""
    if name == TargetOnly.name:
        raise ValueError("stop_policy 'target_only' drafts nothing: for target-only decoding pass no "
                         "speculative_config to vLLM at all")
    if name not in POLICIES:
        raise ValueError(f"unknown stop policy {name!r}: choose one of {sorted(POLICIES)} (or pass a FixedK, SVIP, "
                         "SpecDecPP or OnlineAcceptance object)")
    return POLICIES[name]


def resolve_policy(head, threshold, max_candidates, stop_policy) -> StopPolicy:
    """The call's stop policy, by the keywords of ``specdecpp.hf.generate``: ``head`` (a directory, a
    hub id or a loaded head) at ``threshold``, or ``stop_policy`` (an object, or a name with its
    defaults). ``max_candidates`` bounds a head's drafts (SpecDecPP's default otherwise); a given
    policy carries its own."""
    check_policy_keywords("specdecpp.vllm.speculative_config", head, threshold, stop_policy)
    if max_candidates is not None:
        check_count("specdecpp.vllm.speculative_config", "max_candidates", max_candidates)
    if head is not None:
        if isinstance(head, (str, os.PathLike)):
            head = load_head(head)
        elif not isinstance(head, AcceptanceHead):
            raise TypeError(f"head must be a head directory, a hub id or a specdecpp AcceptanceHead, got "
                            f"{type(head).__name__}")
        settings = {k: v for k, v in (("threshold", threshold), ("max_candidates", max_candidates)) if v is not None}
        return SpecDecPP(head, **settings)
    if stop_policy is None:
        raise ValueError("specdecpp.vllm.speculative_config needs a stop rule: head='path-or-hub-id' (SpecDec++, "
                         "with threshold=...) or stop_policy=SVIP(...) / FixedK(...)")
    if isinstance(stop_policy, str):
        stop_policy = policy_by_name(stop_policy)()
    if not isinstance(stop_policy, StopPolicy):
        raise TypeError(f"stop_policy must be a specdecpp StopPolicy (FixedK, SVIP, SpecDecPP, OnlineAcceptance) or "
                        f"its name, got {type(stop_policy).__name__}")
    policy_by_name(stop_policy.name)  # TargetOnly and policies a bundle cannot rebuild are refused by name
    if type(stop_policy) is not POLICIES[stop_policy.name]:
        raise TypeError(f"stop_policy {type(stop_policy).__name__} cannot be sent to vLLM: a bundle rebuilds only "
                        f"{', '.join(c.__name__ for c in POLICIES.values())} from their settings")
    if max_candidates is not None and max_candidates != stop_policy.max_candidates:
        raise ValueError(f"max_candidates={max_candidates} differs from the policy's own "
                         f"({stop_policy.max_candidates}): set it on the policy")
    return stop_policy


def policy_spec(policy: StopPolicy) -> dict:
    """The JSON a bundle records for ``policy``: its name and the settings its constructor takes."""
    if isinstance(policy, SpecDecPP):
        settings = {k: getattr(policy, k) for k in SPECDECPP_KEYS}
        return {"format": FORMAT, "policy": policy.name, "settings": settings, "head": HEAD_DIR}
    return {"format": FORMAT, "policy": policy.name, "settings": policy.settings()}


def load_aware_spec(load_aware, mode: str) -> dict | None:
    """What a bundle records of ``speculative_config(load_aware=...)``: None (off), or the draft-cost
    mode with the step costs (a :class:`StepCosts`, a path to its JSON) or None (True: the proposer
    measures them at start-up)."""
    if load_aware is None or load_aware is False:
        return None
    if mode not in DRAFT_MODES:
        raise ValueError(f"load_aware_mode must be one of {DRAFT_MODES}, got {mode!r}")
    if load_aware is True:
        costs = None
    elif isinstance(load_aware, StepCosts):
        costs = load_aware.to_json()
    elif isinstance(load_aware, (str, os.PathLike)):
        costs = StepCosts.load(load_aware).to_json()
    else:
        raise TypeError(f"load_aware must be True (measure the step costs at start-up), a StepCosts or the path of "
                        f"its JSON (StepCosts.save), got {type(load_aware).__name__}")
    return {"mode": mode, "costs": costs}


def read_load_aware(bundle: str | os.PathLike) -> dict | None:
    """A bundle's load-aware setting (:func:`load_aware_spec`, its costs as a StepCosts), None if off."""
    path = Path(bundle) / POLICY_FILE
    if not path.is_file():
        return None
    spec = json.loads(path.read_text()).get("load_aware")
    if spec is None:
        return None
    costs = spec.get("costs")
    return {"mode": spec["mode"], "costs": None if costs is None else StepCosts.from_json(costs, where=str(path))}


def read_policy(bundle: str | os.PathLike) -> StopPolicy | None:
    """The stop policy a bundle names (its head loaded from the bundle), or None for a plain draft
    directory (no :data:`POLICY_FILE`)."""
    path = Path(bundle) / POLICY_FILE
    if not path.is_file():
        return None
    spec = json.loads(path.read_text())
    if spec.get("format") != FORMAT:
        raise ValueError(f"{path}: bundle format {spec.get('format')!r}, this specdecpp reads format {FORMAT}; "
                         "rebuild it with specdecpp.vllm.speculative_config")
    cls = policy_by_name(spec["policy"])
    if cls is SpecDecPP:
        return SpecDecPP(load_head(Path(bundle) / spec["head"]), **spec["settings"])
    return cls(**spec["settings"])


def draft_hidden_size(draft: Path) -> int | None:
    """The draft's hidden size from its config.json (a multimodal config's text config's)."""
    config = json.loads((draft / "config.json").read_text())
    return config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")


def check_head(policy: SpecDecPP, draft: Path, draft_name: str | None, sampling) -> None:
    """A head against the draft it is sent with (``specdecpp.models.fit``): the draft recorded at
    training (by name where ``draft_name`` is given, the hidden size always) and, where the caller
    says which sampling it serves with, the head's training sampling."""
    head = policy.head
    if head.needs_position:
        raise ValueError("this lag-free head reads each candidate's position in the response (feature `position`), "
                         "which specdecpp.vllm does not pass yet: use a head trained without it")
    check_draft_fit("head", "head", head.draft, head.hidden_size, draft_name or str(draft), draft_hidden_size(draft),
                    compare_names=draft_name is not None)
    if sampling is not None:
        check_sampling_fit("head", head.dataset_meta.get("sampling"), sampling, "allow_sampling_mismatch")


def check_feature_draft(draft: Path, policy: StopPolicy, draft_name: str | None = None, sampling=None) -> None:
    """What a feature draft (EAGLE-3, the speculators format: vLLM's ``eagle3`` method) is sent with:
    an EAGLE-3 config this project reads, and a policy on the draft's logits alone (FixedK, SVIP,
    OnlineAcceptance) or SpecDec++ with a head of either kind trained on this draft (:func:`check_feature_head`);
    with or without load-aware lengths."""
    from ..models.feature_draft import read_config

    config = read_config(draft)  # a ValueError names what is not an EAGLE-3 speculators config
    if isinstance(policy, SpecDecPP):
        check_feature_head(policy, draft, config, draft_name, sampling)


def check_feature_head(policy: SpecDecPP, draft: Path, config: dict, draft_name: str | None, sampling) -> None:
    """A head sent with a feature draft: either kind (the paper's reads the state vLLM's loop hands the
    proposer at the next pass, the draft's state after feeding the candidate), of the draft's hidden size and
    trained on this draft by name (``specdecpp.models.fit``; every feature draft of a target has the
    target's hidden size, so the size alone cannot tell another one), on a draft that hands its
    final-normed state to the next step (``norm_output``: vLLM gives the draft loop that state, and the
    library's head reads the state fed back). ``draft_name``: the name the head's training recorded for
    this draft where it differs from the directory (a hub id; default: the directory, by identity or path)."""
    head = policy.head
    if head.needs_position:
        raise ValueError("this lag-free head reads each candidate's position in the response (feature `position`), "
                         "which specdecpp.vllm does not pass yet: use a head trained without it")
    if not config["norm_output"]:
        raise ValueError(f"feature draft {str(draft)!r} (EAGLE-3) has norm_output=false: its heads read the pre-norm "
                         "state it feeds back, and vLLM's draft loop hands the proposer only the final-normed one; "
                         "heads are sent with norm_output=true drafts only (FeatureDraft.init_from's default), "
                         "stop policies on the logits (FixedK, SVIP, OnlineAcceptance) with any")
    name = draft_name or str(draft)
    try:
        check_draft_fit("head", "head", head.draft, head.hidden_size, name,
                        config["transformer_layer_config"]["hidden_size"])
    except ValueError as exc:
        hint = "" if draft_name else (" (if the head recorded this draft under another name, e.g. its hub id, pass "
                                      "draft_name=<that name>)")
        raise ValueError(f"feature draft {str(draft)!r} (EAGLE-3): {exc}{hint}") from None
    if sampling is not None:
        check_sampling_fit("head", head.dataset_meta.get("sampling"), sampling, "allow_sampling_mismatch")


def write_bundle(draft: Path, policy: StopPolicy, cache_dir: Path, load_aware: dict | None = None) -> Path:
    """The bundle of ``draft`` and ``policy`` (and the load-aware setting) under ``cache_dir``, named by
    a digest of them (written once; an existing one with the same digest is reused)."""
    spec = policy_spec(policy)
    if load_aware is not None:
        spec["load_aware"] = load_aware
    digest = hashlib.sha256(json.dumps([str(draft), spec], sort_keys=True).encode())
    head_state = None
    if isinstance(policy, SpecDecPP):
        head_state = {k: v.detach().cpu() for k, v in policy.head.state_dict().items()}
        for name in sorted(head_state):
            digest.update(name.encode() + head_state[name].numpy().tobytes())
        digest.update(json.dumps(policy.head._config(), sort_keys=True, default=str).encode())
    bundle = cache_dir / f"{draft.name}-{policy.name}-{digest.hexdigest()[:16]}"
    if (bundle / POLICY_FILE).is_file():
        return bundle
    staging = cache_dir / f".{bundle.name}.{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    for item in sorted(draft.iterdir()):
        if item.name not in (POLICY_FILE, HEAD_DIR) and not (staging / item.name).exists():
            (staging / item.name).symlink_to(item.resolve())
    if head_state is not None:
        meta = policy.head.meta
        policy.head.save_pretrained(staging / HEAD_DIR, training=meta.get("training"), metrics=meta.get("metrics"))
    (staging / POLICY_FILE).write_text(json.dumps(spec, indent=1) + "\n")
    try:
        staging.rename(bundle)
    except OSError:  # another process wrote the same bundle first
        if not (bundle / POLICY_FILE).is_file():
            raise
    return bundle


def speculative_config(draft: str | os.PathLike, head=None, threshold: float | None = None,
                       max_candidates: int | None = None, stop_policy: StopPolicy | str | None = None, *,
                       draft_name: str | None = None, sampling=None, cache_dir: str | os.PathLike | None = None,
                       load_aware=False, load_aware_mode: str = "dense", **vllm_options) -> dict:
    """The ``speculative_config`` of ``vllm.LLM`` that drafts with ``draft`` (a local model directory)
    and stops each request's draft by a stop policy: SpecDec++ with ``head`` at ``threshold`` (within
    ``max_candidates``), or ``stop_policy`` (``SVIP(0.3)``, ``FixedK(2)``, or a name: ``"svip"``).

    ``draft_name``: the name the head's training recorded for this draft, to compare (default: only
    the hidden size is compared). ``sampling``: a :class:`~specdecpp.core.sampling.SamplingConfig`
    to check the head's training sampling against. ``vllm_options``: further keys of vLLM's
    speculative config (e.g. ``draft_sample_method="greedy"``); the method, the model and the
    number of speculative tokens are set here. Writes the policy bundle (module docstring) under
    ``cache_dir`` and returns the dict; nothing of vLLM is started or imported.

    A feature draft (EAGLE-3 in the speculators format, :class:`~specdecpp.FeatureDraft`'s
    ``save_pretrained``; detected by ``is_feature_draft``) gets vLLM's ``eagle3`` method, its requests
    stopped by FixedK, SVIP, OnlineAcceptance or a head of either kind trained on that draft (its recorded
    draft compared by name even without ``draft_name``; :func:`check_feature_draft` says what is refused)."""
    check_version()
    policy = resolve_policy(head, threshold, max_candidates, stop_policy)
    draft_dir = Path(draft).expanduser()
    if not (draft_dir / "config.json").is_file():
        raise ValueError(f"draft {str(draft)!r} is not a local model directory (no config.json): vLLM's draft_model "
                         "method loads a directory; download the draft first (hf download ...)")
    draft_dir = draft_dir.resolve()
    feature = is_feature_draft(draft_dir)
    if feature:
        check_feature_draft(draft_dir, policy, draft_name, sampling)
    elif isinstance(policy, SpecDecPP):
        check_head(policy, draft_dir, draft_name, sampling)
    clash = sorted(set(vllm_options) & set(OWNED_KEYS))
    if clash:
        raise ValueError(f"speculative_config sets {', '.join(clash)} itself: drop them from the keywords")
    load_aware = load_aware_spec(load_aware, load_aware_mode)
    bundle = write_bundle(draft_dir, policy, Path(cache_dir).expanduser() if cache_dir else default_cache_dir(),
                          load_aware)
    # probabilistic: the draft samples from q as the project's decoders do (both are exact)
    return {"method": "eagle3" if feature else "draft_model", "model": str(bundle),
            "num_speculative_tokens": policy.max_candidates, "draft_sample_method": "probabilistic", **vllm_options}


def speculative_config_json(*args, **kwargs) -> str:
    """:func:`speculative_config` as the JSON that ``vllm serve --speculative-config`` takes."""
    return json.dumps(speculative_config(*args, **kwargs))
