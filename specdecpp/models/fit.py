"""Does a head or a labelled dataset fit the pair it is used with? One answer for the library (a
head attached to a loaded draft), ``python -m train`` (a dataset against pair.draft) and ``python -m
infer`` (a head against pair.draft, the sampling and the verification rule).

A head or a dataset records what its labels min(1, p/q) were made with: the draft (its name and
hidden size), the sampling that warped p and q, and the rule (exact, or a cascade's). Each check
compares one recorded value with the one in use and raises a ValueError naming the artifact, both
values and the fixes; ``allow`` names the setting that accepts a mismatch (``allowed``: it is set).
"""

from __future__ import annotations

from ..core.sampling import SamplingConfig
from .identity import same_model

MADE = {"head": "trained on", "dataset": "made with"}
FIXES = {"head": "Train a head for this draft (python -m train) or use the draft it was trained on",
         "dataset": "Labels min(1, p/q) depend on the draft: train with the draft that made them (pair=...) "
                    "or label data with this one (python -m data_gen)"}


def config_hidden_size(config) -> int | None:
    """A transformers config's hidden size (a multimodal config's text config's); None if it has none."""
    size = getattr(config, "hidden_size", None)
    if size is None and hasattr(config, "get_text_config"):
        size = getattr(config.get_text_config(), "hidden_size", None)
    return size


def check_draft_fit(artifact: str, kind: str, made_with: str | None, made_hidden: int | None, draft: str,
                    draft_hidden: int | None, allow: str | None = None, allowed: bool = False,
                    compare_names: bool = True) -> None:
    """``artifact`` (a ``kind`` of ``head`` or ``dataset``, e.g. ``"method.head 'heads/x'"``) was made
    with draft ``made_with`` of hidden size ``made_hidden`` (either None: not recorded); ``draft`` of
    ``draft_hidden`` is in use. Another name for the draft is accepted with ``allowed`` (the same
    model under two names); another hidden size never is (another model). ``compare_names=False``:
    the hidden sizes only (a loaded model, whose configured name the library does not know)."""
    if kind not in MADE:
        raise ValueError(f"check_draft_fit: kind must be one of {list(MADE)}, got {kind!r}")
    verb = MADE[kind]
    renamed = compare_names and made_with is not None and not same_model(str(made_with), str(draft)) and not allowed
    resized = made_hidden is not None and (draft_hidden is None or int(made_hidden) != int(draft_hidden))
    if not (renamed or resized):
        return
    problems = [f"it was {verb} draft {made_with!r} but draft {draft!r} is configured"] if renamed else []
    if resized:
        made = "" if renamed else f" ({verb} draft {made_with or 'unknown'!r})"
        problems.append(f"its draft had hidden_size {made_hidden}{made} "
                        f"but draft {draft!r} has hidden_size {draft_hidden}")
    message = f"{artifact} does not match the configured draft: {'; '.join(problems)}. {FIXES[kind]}"
    if renamed and allow:
        message += (f" ({allow}=true accepts the same model under another name, never another hidden size)"
                    if resized else f", or set {allow}=true if they are the same model under two names")
    raise ValueError(message + ".")


def check_sampling_fit(artifact: str, recorded, sampling: SamplingConfig, allow: str, allowed: bool = False) -> None:
    """A head's labels were computed under its dataset's sampling ``recorded`` (the mapping saved in
    its config; None: not recorded, not checked); temperature, top-k and top-p warp both p and q,
    so its predictions hold only under the same setting (any greedy setting is one)."""
    if not recorded or allowed:
        return
    trained = SamplingConfig.from_mapping(recorded)
    if trained.greedy and sampling.greedy:
        return
    differ = [f"{k}: {getattr(trained, k)!r} in training, {getattr(sampling, k)!r} now"
              for k in ("temperature", "top_k", "top_p") if getattr(trained, k) != getattr(sampling, k)]
    if differ:
        raise ValueError(f"{artifact} was trained on labels sampled under another setting "
                         f"({'; '.join(differ)}); its acceptance predictions do not hold here. Decode with the "
                         "head's setting (sampling=...), train a head on data generated under this one, or pass "
                         f"{allow}=true to use it anyway")


def _rule(cascade: dict | None) -> str:
    return "exact min(1, p/q)" if cascade is None else f"cascade {cascade['rule']} alpha={cascade['alpha']:g}"


def check_labels_fit(artifact: str, recorded: dict | None, cascade: dict | None, allow: str,
                     allowed: bool = False) -> None:
    """A head learns the acceptance of the rule its labels were made under: exact min(1, p/q)
    (``recorded`` None) or a cascade's min(1, pi/q) (``{"rule", "alpha"}``, data_gen's
    ``labels.cascade``); ``cascade`` is the rule it verifies with now (an exact-label head stops
    too early under a lenient cascade)."""
    if allowed or recorded == cascade:
        return
    raise ValueError(f"{artifact} was trained on labels of {_rule(recorded)}, but this method verifies with "
                     f"{_rule(cascade)}; train a head on data_gen labels of this rule (labels.cascade=...), or pass "
                     f"{allow}=true to use it anyway")


def check_head_fit(artifact: str, head, draft: str, draft_hidden: int | None, sampling: SamplingConfig,
                   cascade: dict | None = None, allow: str = "allow_{}_mismatch", allowed: dict | None = None,
                   compare_names: bool = True) -> None:
    """A loaded head (its recorded ``draft``, ``hidden_size`` and ``dataset_meta``) against the draft
    in use, the sampling and the rule (``cascade``, None: exact): the three checks above, as ``python
    -m infer`` and ``specdecpp.hf`` run them. ``allow.format(x)`` names the setting that accepts a
    mismatch of ``x`` in ``draft``, ``sampling``, ``label``; ``allowed[x]`` says it is set."""
    allowed = allowed or {}
    meta = head.dataset_meta
    check_draft_fit(artifact, "head", head.draft, head.hidden_size, draft, draft_hidden, allow.format("draft"),
                    bool(allowed.get("draft", False)), compare_names)
    check_sampling_fit(artifact, meta.get("sampling"), sampling, allow.format("sampling"),
                       bool(allowed.get("sampling", False)))
    check_labels_fit(artifact, (meta.get("labels") or {}).get("cascade"), cascade, allow.format("label"),
                     bool(allowed.get("label", False)))
