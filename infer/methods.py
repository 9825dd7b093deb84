"""Stopping methods from config: check them before any model loads, then build a runner.

A runner has ``timed`` (whether its times are measurements) and
``generate(prompt_ids, max_new_tokens, seed, eos_token_id) -> (output_ids, RunStats, extra)``,
``extra`` holding ``forward_time_s``: the time inside the two models' forward passes, measured
by the same hooks for every runner (wall time minus it is the decoding loop's own overhead).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecpp import (
    SVIP,
    AcceptanceHead,
    FixedK,
    PEARLDecoder,
    SpecDecPP,
    SpeculativeDecoder,
    TargetOnly,
    load_head,
)
from specdecpp.identity import same_model
from specdecpp.policies import check_count, check_threshold
from specdecpp.sampling import SamplingConfig

from .timing import Clock, ForwardMeter

METHODS = ("target_only", "fixed_k", "svip", "specdecpp", "pearl", "hf_assisted", "oracle")
HF_MODES = ("constant", "heuristic", "confidence")


@dataclass
class MethodSpec:
    """A checked method: its name, the settings recorded in every row, the file-name tag."""

    name: str
    settings: dict
    tag: str
    head: AcceptanceHead | None = field(default=None, repr=False)


def _threshold(name: str, value, key: str = "threshold") -> float:
    return check_threshold(f"method {name}", f"method.{key}", value)


def _count(name: str, key: str, value, minimum: int = 1) -> int:
    return check_count(f"method {name}", f"method.{key}", value, minimum)


def head_fingerprint(head: AcceptanceHead) -> str:
    """A short hash of the head's weights: a retrained head in the same directory is another run."""
    digest = hashlib.sha256()
    for name, tensor in sorted(head.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:12]


def _num(x: float) -> str:
    return f"{x:g}"


def draft_hidden_size(draft_ref: str) -> int | None:
    """The draft's hidden size from its config alone (no weights are loaded)."""
    from specdecpp.loading import load_config

    config = load_config(draft_ref)
    size = getattr(config, "hidden_size", None)
    return size if size is not None else getattr(config.get_text_config(), "hidden_size", None)


def load_checked_head(m, draft_ref: str) -> AcceptanceHead:
    """Load the head of ``method.head`` and check it fits the draft, before the models load."""
    head_path = m.get("head")
    if not head_path:
        raise ValueError("method specdecpp: set method.head to a head directory (heads/<experiment>, "
                         "written by `python -m train +experiment=...`)")
    head = load_head(str(head_path))
    size = draft_hidden_size(draft_ref)
    if size != head.hidden_size:
        raise ValueError(f"method.head {str(head_path)!r} has hidden_size {head.hidden_size} (trained on "
                         f"draft {head.draft!r}) but draft {draft_ref!r} has hidden_size {size}: "
                         "train a head for this draft or use the draft the head was trained on")
    if head.draft and not same_model(str(head.draft), str(draft_ref)) and not m.get("allow_draft_mismatch", False):
        raise ValueError(f"method.head {str(head_path)!r} was trained on draft {head.draft!r}, but "
                         f"pair.draft is {draft_ref!r}. Use the matching draft, or pass "
                         "method.allow_draft_mismatch=true if they are the same model under two names")
    return head


def check_head_sampling(head: AcceptanceHead, head_path: str, sampling: SamplingConfig, allow: bool) -> None:
    """A head's labels min(1, p/q) were computed under its dataset's sampling (temperature, top-k,
    top-p warp both p and q): refuse to use it under another setting unless allowed."""
    recorded = ((head.meta.get("training") or {}).get("dataset_meta") or {}).get("sampling")
    if not recorded or allow:
        return
    trained = SamplingConfig.from_mapping(recorded)
    if trained.greedy and sampling.greedy:
        return
    differ = [f"{k}: {getattr(trained, k)!r} in training, {getattr(sampling, k)!r} now"
              for k in ("temperature", "top_k", "top_p") if getattr(trained, k) != getattr(sampling, k)]
    if differ:
        raise ValueError(f"method.head {head_path!r} was trained on labels sampled under another setting "
                         f"({'; '.join(differ)}); its acceptance predictions do not hold here. Decode with the "
                         "head's setting (sampling=...), train a head on data generated under this one, or pass "
                         "method.allow_sampling_mismatch=true to use it anyway")


def resolve_method(m, draft_ref: str, sampling: SamplingConfig) -> MethodSpec:
    """Check a ``method`` config node (no model is loaded; a head is loaded and checked)."""
    name = m.get("name")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)} "
                         "(method=<name> on the command line)")
    if name == "target_only":
        return MethodSpec(name, {}, "base")
    if name == "fixed_k":
        k = _count(name, "k", m.get("k"))
        return MethodSpec(name, {"k": k}, f"k{k}")
    if name == "svip":
        h = _threshold(name, m.get("threshold"))
        c = m.get("c")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0:
            raise ValueError(f"method svip: method.c must be a number > 0, got {c!r}")
        mx = _count(name, "max_candidates", m.get("max_candidates"))
        return MethodSpec(name, {"threshold": h, "c": float(c), "max_candidates": mx},
                          f"h{_num(h)}_c{_num(c)}_max{mx}")
    if name == "specdecpp":
        h = _threshold(name, m.get("threshold"))
        lo = _count(name, "min_candidates", m.get("min_candidates"))
        hi = _count(name, "max_candidates", m.get("max_candidates"))
        if lo > hi:
            raise ValueError(f"method specdecpp: method.min_candidates ({lo}) > method.max_candidates ({hi})")
        head = load_checked_head(m, draft_ref)
        check_head_sampling(head, str(m.get("head")), sampling, bool(m.get("allow_sampling_mismatch", False)))
        head_name = Path(str(m.get("head")).rstrip("/")).name
        settings = {"head": str(m.get("head")), "head_sha": head_fingerprint(head), "head_depth": head.depth,
                    "head_kind": head.kind, "threshold": h, "min_candidates": lo, "max_candidates": hi}
        return MethodSpec(name, settings, f"{head_name}_h{_num(h)}_min{lo}_max{hi}", head)
    if name == "pearl":
        return _pearl_spec(m)
    if name == "hf_assisted":
        mode = m.get("mode")
        if mode not in HF_MODES:
            raise ValueError(f"method hf_assisted: method.mode must be one of {', '.join(HF_MODES)}, got {mode!r}")
        n = _count(name, "num_assistant_tokens", m.get("num_assistant_tokens"))
        settings = {"mode": mode, "num_assistant_tokens": n}
        tag = f"{mode}_n{n}"
        if mode == "confidence":
            settings["confidence_threshold"] = _threshold(name, m.get("confidence_threshold"), "confidence_threshold")
            tag += f"_c{_num(settings['confidence_threshold'])}"
        return MethodSpec(name, settings, tag)
    if not sampling.greedy:  # oracle
        raise ValueError("method oracle is defined for greedy decoding only: add sampling=greedy")
    return MethodSpec(name, {}, "oracle")


def _pearl_spec(m) -> MethodSpec:
    gamma = m.get("gamma")
    if gamma != "auto":
        gamma = _count("pearl", "gamma", gamma)
    stop = m.get("stop")
    if stop not in (None, "svip"):
        raise ValueError(f"method pearl: method.stop must be null or svip, got {stop!r}")
    threads, interval = m.get("num_threads"), m.get("switch_interval")
    if threads is not None:
        _count("pearl", "num_threads", threads)
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0):
        raise ValueError(f"method pearl: method.switch_interval must be a number of seconds > 0 or null, got {interval!r}")
    settings = {"gamma": gamma, "stop": stop, "num_threads": threads, "switch_interval": interval}
    tag = f"g{gamma}"
    if stop == "svip":
        h, c = _threshold("pearl", m.get("threshold")), m.get("c")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0:
            raise ValueError(f"method pearl: method.c must be a number > 0, got {c!r}")
        settings.update(threshold=h, c=float(c))
        tag += f"_svip_h{_num(h)}_c{_num(c)}"
    if threads != 1:
        tag += f"_t{threads}"
    return MethodSpec("pearl", settings, tag)


class EngineRunner:
    """Our engine (specdecpp.SpeculativeDecoder) with one stop policy. The forward meters
    synchronise CUDA per forward only with ``profile`` (else ``forward_time_s`` is None on CUDA)."""

    timed = True

    def __init__(self, decoder: SpeculativeDecoder, profile: bool = False) -> None:
        self.decoder = decoder
        self.clock = Clock(decoder.device, sync=profile)

    def generate(self, prompt_ids, max_new_tokens, seed, eos_token_id):
        with ForwardMeter(self.decoder.draft, self.clock) as d, ForwardMeter(self.decoder.target, self.clock) as t:
            out = self.decoder.generate(prompt_ids, max_new_tokens, torch.Generator().manual_seed(seed),
                                        eos_token_id=eos_token_id)
        forward = d.seconds + t.seconds if self.clock.exact else None
        return out.tokens[0, prompt_ids.shape[1]:].tolist(), out.stats, {"forward_time_s": forward}


class PEARLRunner:
    """specdecpp.PEARLDecoder. Its two models run at once, so the forward hooks' sum is no share of
    the wall time (``forward_time_s`` is None); the row gets PEARL's own counts instead."""

    timed = True

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


def _policy(spec: MethodSpec):
    s = spec.settings
    if spec.name == "target_only":
        return TargetOnly()
    if spec.name == "fixed_k":
        return FixedK(s["k"])
    if spec.name == "svip":
        return SVIP(s["threshold"], c=s["c"], max_candidates=s["max_candidates"])
    return SpecDecPP(spec.head, s["threshold"], s["min_candidates"], s["max_candidates"])


def build_runner(spec: MethodSpec, draft, target, sampling: SamplingConfig, profile: bool = False):
    """``profile``: synchronise CUDA around every forward pass / round to split the time between the
    models (slower: not for the timed comparison); no effect on CPU, where times are exact anyway."""
    if spec.name == "hf_assisted":
        from .hf_assisted import HFAssistedRunner

        return HFAssistedRunner(draft, target, sampling, **spec.settings, profile=profile)
    if spec.name == "oracle":
        from .oracle import OracleRunner

        return OracleRunner(draft, target, sampling)
    if spec.name == "pearl":
        s = spec.settings
        stop = SVIP(s["threshold"], c=s["c"], max_candidates=40) if s["stop"] == "svip" else None
        return PEARLRunner(PEARLDecoder(draft, target, s["gamma"], sampling, policy=stop,
                                        num_threads=s["num_threads"], switch_interval=s["switch_interval"]))
    return EngineRunner(SpeculativeDecoder(draft, target, _policy(spec), sampling, profile=profile), profile)


__all__ = ["HF_MODES", "METHODS", "EngineRunner", "PEARLRunner", "MethodSpec", "build_runner", "resolve_method"]
