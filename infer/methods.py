"""Stopping methods from config: build each one before any model loads, then a runner for it.

A method config (conf/method/<name>.yaml) names what it builds with ``_target_``: a stop policy of
the library (``specdecpp.FixedK``, ``specdecpp.SVIP``, ``specdecpp.SpecDecPP``,
``specdecpp.TargetOnly``), run by our engine, or a method of this app that is no stop policy
(:class:`infer.hf_assisted.HFAssisted`, :class:`infer.oracle.Oracle`, :class:`PEARLMethod`,
:class:`SequoiaMethod`, :class:`infer.hf_custom.HFCustom`), which
makes its own runner. ``hf_custom`` (transformers' ``custom_generate`` door) wraps a stop policy
that :func:`resolve_method` builds exactly as ``method=<stop>`` would (:func:`door_policy_config`).
``hydra.utils.instantiate`` calls the target with the config's settings, so
its constructor is the one check of them; only ``name`` and the head's pair checks
(``allow_*_mismatch``) are infer's own keys.

A runner has ``timed`` (whether its times are measurements) and
``generate(prompt_ids, max_new_tokens, seed, eos_token_id) -> (output_ids, RunStats, extra)``,
``extra`` holding ``forward_time_s``: the time inside the two models' forward passes, measured
by the same hooks for every runner (wall time minus it is the decoding loop's own overhead).

The fast path (``fast``, docs/engine.md "The fast path") reaches every method that decodes with our
engine's runners (:func:`takes_fast`: the stop policies, cascades, PEARL (static only), Sequoia);
``hf_assisted``, ``hf_custom`` (transformers' generate) and ``oracle`` (untimed counts) ignore it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specdecpp import (
    SVIP,
    AcceptanceHead,
    Cascade,
    FixedK,
    PEARLDecoder,
    SequoiaDecoder,
    SpecDecPP,
    SpeculativeDecoder,
    StopPolicy,
    TokenTree,
    load_head,
)
from specdecpp.analysis.costmodel import load_costs
from specdecpp.analysis.tree_search import choose_tree
from specdecpp.core.sampling import SamplingConfig
from specdecpp.core.timing import Clock
from specdecpp.decoders.pearl import MAX_AUTO_GAMMA
from specdecpp.models.fit import check_head_fit, config_hidden_size

from .acceptance import load_acceptance
from .hf_assisted import HF_MODES
from .meters import FeedMeters, ForwardMeter
from .runner import MethodRunner
from .tags import method_tag

METHODS = ("target_only", "fixed_k", "svip", "specdecpp", "pearl", "sequoia", "hf_assisted", "hf_custom", "oracle",
           "cascade")
LOSSY_METHODS = ("cascade",)  # their rows say lossy: true; the report shows them with their quality
METHOD_DIR = Path(__file__).resolve().parents[1] / "conf" / "method"
# keys of a method config that infer reads itself; every other key goes to the ``_target_``
APP_KEYS = ("name", "allow_draft_mismatch", "allow_sampling_mismatch", "allow_label_mismatch")


@dataclass
class MethodSpec:
    """A built method: its name, the settings recorded in every row, the file-name tag, the object
    its config instantiated (a StopPolicy, or a method with ``runner(...)``) and the head."""

    name: str
    settings: dict
    tag: str
    head: AcceptanceHead | None = field(default=None, repr=False)
    method: object = field(default=None, repr=False)


def method_config(name: str, settings=None) -> DictConfig:
    """conf/method/<name>.yaml with ``settings`` merged over it (a comparison entry, or a node
    given from Python without the keys it leaves at their defaults)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)} "
                         "(method=<name> on the command line)")
    return OmegaConf.merge(OmegaConf.load(METHOD_DIR / f"{name}.yaml"), settings or {})


def instantiate_method(m, **objects):
    """``hydra.utils.instantiate`` of a method config (its ``_target_`` with every key but
    :data:`APP_KEYS`; ``objects`` are built arguments, such as the loaded head). A constructor's
    refusal is raised as itself, not wrapped in Hydra's error, so its message names the setting,
    e.g. ``SVIP: threshold must be a number in [0, 1], got 2`` for method.threshold=2."""
    name = m.get("name")
    node = {k: v for k, v in OmegaConf.to_container(m, resolve=True).items() if k not in APP_KEYS}
    if "_target_" not in node:
        raise ValueError(f"method {name}: the config has no _target_ (the class it builds); see "
                         f"conf/method/{name}.yaml")
    try:
        return instantiate(node, **objects)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, (ValueError, TypeError)):
            cause.add_note(f"in the settings of method={name} (conf/method/{name}.yaml; override with "
                           "method.<setting>=...)")
            raise cause from None
        raise


def head_fingerprint(head: AcceptanceHead) -> str:
    """A short hash of the head's weights: a retrained head in the same directory is another run."""
    digest = hashlib.sha256()
    for name, tensor in sorted(head.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:12]


def load_checked_head(m, draft_ref: str, sampling: SamplingConfig, cascade: dict | None = None) -> AcceptanceHead:
    """Load the head of ``method.head`` and check it fits the draft (from its config alone: no
    weights load), the sampling and the verification rule (``cascade``, None: exact) before the
    models load (``specdecpp.models.fit``; ``method.allow_*_mismatch`` accept a mismatch)."""
    from specdecpp.models.loading import load_config

    head_path = m.get("head")
    if not head_path:
        raise ValueError(f"method {m.get('name')}: set method.head to a head directory (heads/<experiment>, "
                         "written by `python -m train +experiment=...`)")
    head = load_head(str(head_path))
    check_head_fit(f"method.head {str(head_path)!r}", head, draft_ref, config_hidden_size(load_config(draft_ref)),
                   sampling, cascade, "method.allow_{}_mismatch",
                   {x: m.get(f"allow_{x}_mismatch", False) for x in ("draft", "sampling", "label")})
    return head


DOOR_STOPS = ("fixed_k", "svip", "specdecpp")  # the policies method=hf_custom runs through transformers' door


def door_policy_config(m) -> DictConfig:
    """The config of the stop policy that ``method=hf_custom`` (conf/method/hf_custom.yaml) runs:
    conf/method/<stop>.yaml with the hf_custom keys that are set (null: that file's value). A key
    set that the policy has not is refused, naming it."""
    stop = m.get("stop")
    if stop not in DOOR_STOPS:
        raise ValueError(f"hf_custom: stop must be one of {', '.join(DOOR_STOPS)}, got {stop!r} "
                         "(method.stop=...)")
    policy = method_config(stop)
    own = {"_target_", "name", "stop"}
    given = {k: v for k, v in OmegaConf.to_container(m, resolve=True).items() if k not in own and v is not None}
    foreign = sorted(set(given) - set(policy))
    if foreign:
        raise ValueError(f"hf_custom: stop={stop} has no setting {', '.join(foreign)} (conf/method/{stop}.yaml "
                         f"has {', '.join(k for k in policy if k not in own) or 'none'})")
    return OmegaConf.merge(policy, given)


def resolve_method(m, draft_ref: str, sampling: SamplingConfig) -> MethodSpec:
    """Build the method of a ``method`` config node (no model is loaded; a head is loaded and
    checked against the pair and the sampling first)."""
    name = m.get("name")
    m = method_config(name, m)
    if name == "hf_custom":  # the door around a policy built as method=<stop> builds it
        inner = door_policy_config(m)
        policy = resolve_method(inner, draft_ref, sampling)
        allowed = {k: bool(inner[k]) for k in APP_KEYS if k.startswith("allow_") and k in inner}  # the door checks too
        method = instantiate_method(OmegaConf.create({k: m.get(k) for k in ("_target_", "name", "stop")}),
                                    policy=policy, allowed=allowed)
        settings = method.settings()
        return MethodSpec(name, settings, method_tag(name, settings), policy.head, method)
    objects, head, settings = {}, None, {}
    if name == "specdecpp" or (name in ("pearl", "cascade") and m.get("stop") == "specdecpp"):
        head = load_checked_head(m, draft_ref, sampling,
                                 {"rule": m.get("rule"), "alpha": m.get("alpha")} if name == "cascade" else None)
        objects["head"] = head
        settings = {"head": str(m.get("head")), "head_sha": head_fingerprint(head)}
    method = instantiate_method(m, **objects)
    if hasattr(method, "check_sampling"):
        method.check_sampling(sampling)
    settings.update(method.settings())
    return MethodSpec(name, settings, method_tag(name, settings, getattr(method, "tag_keys", None)), head, method)


def takes_fast(spec: MethodSpec) -> bool:
    """Whether the method decodes with our engine's runners, which the fast path replaces."""
    return isinstance(spec.method, StopPolicy) or bool(getattr(spec.method, "takes_fast", False))


class PEARLMethod:
    """PEARL (specdecpp.PEARLDecoder) from config, checked before the models load by the decoder's
    own ``check_settings``. ``stop`` ends a draft block early under a stop policy: ``svip``
    (threshold, c) or ``specdecpp`` (a head of either kind from ``head``, at ``threshold``); each
    policy checks its own settings."""

    STOPS = (None, "svip", "specdecpp")
    takes_fast = True
    tag_keys = ("gamma", "stop", "head", "threshold", "c", "num_threads")  # infer.tags: g4_svip_h0.5_c0.15_t2

    def __init__(self, gamma: int | str = "auto", stop: str | None = None, threshold: float = 0.5, c: float = 0.15,
                 num_threads: int | None = 1, switch_interval: float | None = 1e-4,
                 head: AcceptanceHead | None = None) -> None:
        PEARLDecoder.check_settings(gamma, num_threads, switch_interval)
        if stop not in self.STOPS:
            raise ValueError(f"PEARL: stop must be null, svip or specdecpp, got {stop!r}")
        if stop == "specdecpp" and not isinstance(head, AcceptanceHead):
            raise ValueError("PEARL: stop=specdecpp needs method.head, a head directory "
                             "(heads/<experiment>, written by `python -m train +experiment=...`)")
        self.gamma, self.stop, self.num_threads, self.switch_interval = gamma, stop, num_threads, switch_interval
        self.policy = (SVIP(threshold, c=c, max_candidates=40) if stop == "svip" else
                       SpecDecPP(head, threshold, max_candidates=MAX_AUTO_GAMMA) if stop == "specdecpp" else None)

    def settings(self) -> dict:
        settings = {"gamma": self.gamma, "stop": self.stop, "num_threads": self.num_threads,
                    "switch_interval": self.switch_interval}
        if self.stop == "svip":
            settings.update(threshold=self.policy.threshold, c=self.policy.c)
        elif self.stop == "specdecpp":
            settings.update(threshold=self.policy.threshold, head_kind=self.policy.head.kind)
        return settings

    @staticmethod
    def check_fast(fast) -> None:
        PEARLDecoder.check_fast(fast)  # static only: the draft runs on a second thread

    def runner(self, draft, target, sampling: SamplingConfig, profile: bool = False, fast: str | None = None):
        return PEARLRunner(PEARLDecoder(draft, target, self.gamma, sampling, policy=self.policy,
                                        num_threads=self.num_threads, switch_interval=self.switch_interval, fast=fast))


class SequoiaMethod:
    """Sequoia (specdecpp.SequoiaDecoder) from config: ``tree`` is a tree JSON file (``python -m
    infer.sequoia tree`` writes one) or a list of parent indices; or, with ``tree: null``, the tree
    is chosen here by the DP from ``acceptance`` (``python -m infer.sequoia measure``'s file) and
    ``costs`` (a costs.json with both width curves) over tree sizes ``sizes`` (default: the measured
    widths) and depths <= ``max_depth``."""

    takes_fast = True

    def __init__(self, tree=None, acceptance: str | None = None, costs: str | None = None,
                 sizes: list[int] | None = None, max_depth: int = 12) -> None:
        if tree is not None:
            self.tree = TokenTree.coerce(list(tree) if not isinstance(tree, (str, Path)) else tree)
            self.source = str(tree) if isinstance(tree, (str, Path)) else "list"
        else:
            if not acceptance or not costs:
                raise ValueError("sequoia: set method.tree (a tree JSON file or a list of parents), or both "
                                 "method.acceptance (python -m infer.sequoia measure) and method.costs (python -m "
                                 "infer.costs --max-width 64) for the DP to choose one")
            p = load_acceptance(acceptance)["acceptance"]
            self.tree, _ = choose_tree(p, load_costs(costs), list(sizes) if sizes else None, max_depth)
            self.source = f"dp({acceptance}, {costs})"

    def settings(self) -> dict:
        return {"tree_size": self.tree.size, "tree_depth": self.tree.depth, "parents": list(self.tree.parents),
                "tree_source": self.source, "expected_tokens": self.tree.meta.get("expected_tokens")}

    def runner(self, draft, target, sampling: SamplingConfig, profile: bool = False, fast: str | None = None):
        return SequoiaRunner(SequoiaDecoder(draft, target, self.tree, sampling, profile=profile, fast=fast), profile)


class CascadeMethod:
    """A speculative cascade (LOSSY, opt-in): ``specdecpp.Cascade(rule, alpha)`` in our engine with
    a stop policy: ``stop=fixed_k`` (``k``), ``svip`` (``threshold``, ``c``) or ``specdecpp``
    (``head`` of either kind, ``threshold``); each part checks its own settings."""

    STOPS = ("fixed_k", "svip", "specdecpp")
    lossy = True
    takes_fast = True
    tag_keys = ("rule", "alpha", "stop", "policy.k", "head", "policy.threshold")  # infer.tags: opt_a0.1_svip_h0.5

    def __init__(self, rule: str = "opt", alpha: float = 0.1, stop: str = "fixed_k", k: int = 4,
                 threshold: float = 0.5, c: float = 0.15, max_candidates: int = 20,
                 head: AcceptanceHead | None = None) -> None:
        self.cascade = Cascade(rule, alpha)
        if stop not in self.STOPS:
            raise ValueError(f"cascade: stop must be one of {', '.join(self.STOPS)}, got {stop!r}")
        if stop == "specdecpp" and not isinstance(head, AcceptanceHead):
            raise ValueError("cascade: stop=specdecpp needs method.head, a head directory")
        self.stop = stop
        self.policy = (FixedK(k) if stop == "fixed_k" else SVIP(threshold, c=c, max_candidates=max_candidates)
                       if stop == "svip" else SpecDecPP(head, threshold, max_candidates=max_candidates))

    def settings(self) -> dict:
        return {"rule": self.cascade.rule, "alpha": self.cascade.alpha, "stop": self.stop,
                "policy": self.policy.settings(), "lossy": True}

    def runner(self, draft, target, sampling: SamplingConfig, profile: bool = False, fast: str | None = None):
        return EngineRunner(SpeculativeDecoder(draft, target, self.policy, sampling, profile=profile,
                                               cascade=self.cascade, fast=fast), profile)


class EngineRunner(MethodRunner):
    """Our engine (specdecpp.SpeculativeDecoder) with one stop policy. The forward meters
    synchronise CUDA per forward only with ``profile`` (else ``forward_time_s`` is None on CUDA).
    On the fast path, whose steps bypass the models' hooks, ``forward_time_s`` is the time inside
    the static runners' forward steps (``meters.FeedMeters``; the mask and the padding around a
    step count as the loop's, as transformers' own mask building counts as the forward's eagerly);
    where rounds were replayed as CUDA graphs (``replayed_rounds`` in the row), None."""

    batched = True

    def __init__(self, decoder: SpeculativeDecoder, profile: bool = False) -> None:
        self.decoder = decoder
        self.clock = Clock(decoder.device, sync=profile)

    def warm_up(self, prompt_len: int, max_new_tokens: int, batch_size: int | None = None,
                progress: bool = False) -> float:
        """The fast path's sizing and compilation for calls up to this long (the decoder's
        ``warm_up``; ``batch_size``: for its ``generate_batch``; ``progress``: a bar over the
        steps), untimed; its seconds."""
        return self.decoder.warm_up(prompt_len, max_new_tokens, batch_size, progress)

    def generate(self, prompt_ids, max_new_tokens, seed, eos_token_id):
        decoder, hooked = self.decoder, self.decoder.fast is None
        runners = decoder.runners
        if not hooked:  # the fast path's steps bypass the models' hooks: time them around the runners' steps
            decoder.runners = FeedMeters(runners, {id(decoder.draft): "draft", id(decoder.target): "target"},
                                         self.clock)
        try:
            with ForwardMeter(decoder.draft, self.clock, enabled=hooked) as d, \
                    ForwardMeter(decoder.target, self.clock, enabled=hooked) as t:
                out = decoder.generate(prompt_ids, max_new_tokens, torch.Generator().manual_seed(seed),
                                       eos_token_id=eos_token_id)
        finally:
            meters, decoder.runners = decoder.runners, runners
        seconds = d.seconds + t.seconds if hooked else meters.total(part="step")
        # captured rounds (specdecpp/decoders/captured.py): no step is timed inside
        replayed = out.stats.replayed_rounds
        return out.tokens[0, prompt_ids.shape[1]:].tolist(), out.stats, {
            "forward_time_s": seconds if self.clock.exact and not replayed else None,
            "row": {"replayed_rounds": replayed}}

    def generate_batch(self, prompts, max_new_tokens, seeds, eos_token_id, batch_size, fill: bool = False):
        """``generate`` for a list of prompt_ids [1, L], ``batch_size`` rows at once (continuous
        batching; ``fill``: see ``SpeculativeDecoder.generate_batch``); returns one
        ``(output_ids, RunStats, extra)`` per prompt and the call's wall time. ``forward_time_s`` of
        a row is None (its forwards are its batch-mates' too); every row records the call's rounds
        (``batch_rounds``)."""
        clock = Clock(self.decoder.device)  # synchronised: the call's wall time is the measurement
        start = clock.now()
        outs = self.decoder.generate_batch([p[0] for p in prompts], max_new_tokens,
                                           [torch.Generator().manual_seed(s) for s in seeds],
                                           eos_token_id=eos_token_id, batch_size=batch_size, fill=fill)
        wall = clock.now() - start
        return [(o.tokens[0, p.shape[1]:].tolist(), o.stats,
                 {"forward_time_s": None, "row": {"batch_rounds": [list(r) for r in o.batch_rounds]}})
                for p, o in zip(prompts, outs, strict=True)], wall


class SequoiaRunner(EngineRunner):
    """specdecpp.SequoiaDecoder, timed as our engine; the row gets the tree's size and the tokens
    per target call."""

    batched = False  # a tree decoder decodes one prompt at a time

    def generate(self, prompt_ids, max_new_tokens, seed, eos_token_id):
        output_ids, s, extra = super().generate(prompt_ids, max_new_tokens, seed, eos_token_id)
        widths = {str(w): s.draft_widths.count(w) for w in sorted(set(s.draft_widths))}
        extra["row"] = {"tree_size": s.tree_size, "tree_depth": s.tree_depth, "n_draft_tokens": s.n_draft_tokens,
                        "draft_widths": widths,
                        "tokens_per_target_call": s.tokens_per_target_call, "accepted_ranks": s.accepted_ranks}
        return output_ids, s, extra


class PEARLRunner(MethodRunner):
    """specdecpp.PEARLDecoder. Its two models run at once, so the forward hooks' sum is no share of
    the wall time (``forward_time_s`` is None); the row gets PEARL's own counts instead."""

    def __init__(self, decoder: PEARLDecoder) -> None:
        self.decoder = decoder

    def generate(self, prompt_ids, max_new_tokens, seed, eos_token_id):
        out = self.decoder.generate(prompt_ids, max_new_tokens, torch.Generator().manual_seed(seed),
                                    eos_token_id=eos_token_id)
        s = out.stats
        row = {"gamma_used": s.gamma, "overlap_time_s": s.overlap_time_s, "n_no_target_token": s.n_no_target_token,
               "n_pre_verify_rounds": s.n_pre_verify_rounds, "n_post_verify_rounds": s.n_post_verify_rounds,
               "theorem1_costs": self.decoder.costs}
        return out.tokens[0, prompt_ids.shape[1]:].tolist(), s, {"forward_time_s": None, "row": row}


def build_runner(spec: MethodSpec, draft, target, sampling: SamplingConfig, profile: bool = False,
                 fast: str | None = None, capture_rounds: bool | str = True):
    """A stop policy runs in our engine; any other method makes its own runner. ``profile``:
    synchronise CUDA around every forward pass / round to split the time between the models
    (slower: not for the timed comparison); no effect on CPU, where times are exact anyway.
    ``fast``: the fast path's backend, for a method that :func:`takes_fast` (None otherwise);
    ``capture_rounds``: a stop policy's (:class:`~specdecpp.decoders.chain.SpeculativeDecoder`)."""
    if isinstance(spec.method, StopPolicy):
        return EngineRunner(SpeculativeDecoder(draft, target, spec.method, sampling, profile=profile, fast=fast,
                                               capture_rounds=capture_rounds), profile)
    return spec.method.runner(draft, target, sampling, profile=profile, **({"fast": fast} if fast else {}))


__all__ = ["APP_KEYS", "HF_MODES", "METHODS", "EngineRunner", "MethodSpec", "PEARLMethod", "PEARLRunner",
           "SequoiaMethod", "SequoiaRunner",
           "build_runner", "instantiate_method", "method_config", "resolve_method", "takes_fast"]
