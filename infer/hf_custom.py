"""The project's decoder through transformers' own door, in our harness (``method=hf_custom``).

The runner decodes with ``target.generate(prompt_ids, custom_generate=specdecpp.hf.generate,
draft_model=draft, stop_policy=policy, ...)``: the stop policy built exactly as ``method=<stop>``
builds it for the direct decoder (:func:`infer.methods.door_policy_config`), the sampling and
the EOS set passed as ``generate``'s own arguments (no ``generation_config`` object: one or the
other, see infer/hf_assisted.py), the checkpoint's extra logits processors switched off as for
``hf_assisted`` (so ``generate`` builds none but the sampling warpers). Run beside the direct
decoder with the same policy, interleaved, it shows what
the door costs: the wall time is taken around ``generate`` (its preparation included), the two
models' forward passes are timed by the same hooks as every runner, and the row adds the
decoder's own wall time inside ``generate`` (``door_inner_wall_time_s``). Each prompt is seeded
from the same (seed, prompt id) as every method: ``torch.manual_seed`` (``generate`` samples
from torch's global generator).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from specdecpp import StopPolicy
from specdecpp.core.sampling import SamplingConfig
from specdecpp.core.timing import Clock

from .hf_assisted import generation_settings
from .meters import ForwardMeter
from .runner import MethodRunner

if TYPE_CHECKING:
    from .methods import MethodSpec


def door_call(**keywords) -> tuple:
    """``(custom_generate, keywords for generate)``: ``specdecpp.hf.generate`` and the door's own
    keywords as a user passes them to ``generate``, where this transformers passes a callable the
    keywords its signature names (5.x); 4.56 does not, so there they are bound in the callable
    (``functools.partial``, as docs/hf.md says for 4.56)."""
    from transformers import GenerationMixin

    from specdecpp.hf import generate

    if hasattr(GenerationMixin, "_extract_generation_mode_kwargs"):
        return generate, keywords
    return functools.partial(generate, **keywords), {}


class HFCustom:
    """The method ``hf_custom`` (conf/method/hf_custom.yaml): the door around ``policy``, the stop
    policy's own method (``resolve_method`` of conf/method/<stop>.yaml), whose settings (and so
    whose tag) it keeps, after ``stop``; ``allowed``: its ``allow_*_mismatch`` switches, which the
    door's own head check gets too."""

    def __init__(self, stop: str, policy: MethodSpec, allowed: dict | None = None) -> None:
        if policy.name != stop or not isinstance(policy.method, StopPolicy):
            raise ValueError(f"hf_custom: stop={stop!r} needs that stop policy's method, got {policy.name!r}")
        self.stop, self.policy, self.allowed = stop, policy, dict(allowed or {})

    def settings(self) -> dict:
        return {"stop": self.stop, **self.policy.settings}

    def runner(self, draft, target, sampling: SamplingConfig, profile: bool = False) -> HFCustomRunner:
        return HFCustomRunner(draft, target, sampling, self.policy.method, self.allowed, profile=profile)


class HFCustomRunner(MethodRunner):

    def __init__(self, draft, target, sampling: SamplingConfig, policy: StopPolicy, allowed: dict | None = None,
                 profile: bool = False) -> None:
        self.draft, self.target, self.sampling, self.policy = draft, target, sampling, policy
        self.allowed = dict(allowed or {})  # allow_*_mismatch: the door checks a head as infer does
        self.clock = Clock(target.device)  # wall time
        self.meter_clock = Clock(target.device, sync=profile)  # per forward: syncs only when profiling

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, seed: int, eos_token_id):
        # as generate's own arguments, None overrides a checkpoint's min_new_tokens; hf_assisted's 0 (its
        # generation_config object would take the checkpoint's value for a None) adds a MinLengthLogitsProcessor
        # that changes nothing but that the door would apply to both models' logits at every position
        settings = {**generation_settings(self.sampling, max_new_tokens, eos_token_id), "min_new_tokens": None,
                    "min_length": 0}
        door, extra = door_call(draft_model=self.draft, stop_policy=self.policy, **self.allowed)
        torch.manual_seed(seed)  # generate samples from torch's global generator
        with ForwardMeter(self.draft, self.meter_clock) as d, ForwardMeter(self.target, self.meter_clock) as t:
            t0 = self.clock.now()
            out = self.target.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), custom_generate=door,
                                       return_dict_in_generate=True, **extra, **settings)
            wall = self.clock.now() - t0
        stats = out.run_stats[0]
        inner = stats.wall_time_s
        stats.wall_time_s = wall  # the door's cost is in the measurement: generate's preparation included
        forward = d.seconds + t.seconds if self.meter_clock.exact else None
        if not self.meter_clock.exact:
            stats.draft_time_s = stats.target_time_s = float("nan")
        else:
            stats.draft_time_s, stats.target_time_s = d.seconds, t.seconds
        start = prompt_ids.shape[1]
        return (out.sequences[0, start:start + stats.n_generated].tolist(), stats,
                {"forward_time_s": forward, "row": {"door_inner_wall_time_s": inner}})
