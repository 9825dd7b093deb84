"""Hugging Face assisted generation (``target.generate(assistant_model=draft)``) in our harness.

transformers decides the candidate lengths; we only count and time. Forward hooks on the two
models count their forward passes (N_draft, N_target) and time them (synchronising CUDA), the
draft passes between two target passes give the round's candidate length, and a streamer sees
each round's accepted tokens. Wall time is taken around ``generate`` with the same clock as the
engine. The modes map to transformers' generation-config keys on the assistant:

- ``constant``: num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0
- ``heuristic``: schedule "heuristic" (+2 after a fully accepted round, else -1, floor 1)
- ``confidence``: schedule "constant" with num_assistant_tokens as the cap, and drafting stops
  when the draft's probability of its token falls below assistant_confidence_threshold
  (transformers adapts that threshold during generation only when scikit-learn is installed)

The assistant's settings are reset before every prompt, so every prompt starts from the
configured values (transformers otherwise carries the heuristic's length over between calls).

transformers' draft calls feed the tokens accepted since the last round (2-3 at a time) and keep
one logit by slicing the hidden state; on a CPU in bf16 that slice sends oneDNN down a slow path
(the demo draft's call costs about 7 ms instead of 2-4). ``GatherKeptLogits`` hands both models an
index tensor instead during ``generate`` (the same logits, as our engine computes them), so HF is
timed on the same footing as our methods.

transformers' assisted generation calls the draft's own ``generate`` every round
(``AssistedCandidateGenerator._generate_candidates``) with a ``generation_config`` together with
``min_new_tokens`` / ``max_new_tokens`` and the target's ``use_cache``. transformers 5.x logs that
as deprecated ("Passing `generation_config` together with generation-related arguments"), 4.56
logs that the draft's generation config changed defaults (our ``num_assistant_tokens``, ...).
Neither is about our call (which passes a ``generation_config`` and no generation argument), and
a plain ``target.generate(ids, assistant_model=draft, max_new_tokens=8)`` logs the same: while we
decode, :func:`quiet_assistant_calls` drops exactly those two messages, and only inside the
draft's own ``generate``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from specdecpp.core.attention import decode_attention
from specdecpp.core.hooks import GatherKeptLogits
from specdecpp.core.sampling import SamplingConfig
from specdecpp.core.timing import Clock
from specdecpp.decoders.rounds import RunStats
from specdecpp.models.loading import token_set
from specdecpp.stopping.policies import check_count, check_threshold

from .meters import ForwardMeter
from .runner import MethodRunner

# Logits processors a checkpoint's generation_config.json could switch on (transformers fills
# every unset key from it): set to their no-op values, so HF samples from the same warped
# distribution as our engine.
NEUTRAL = {"num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "typical_p": 1.0,
           "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0}


# What transformers logs about its own call of the draft's generate (see the module docstring):
# 5.x, then 4.56. Dropped inside that call only.
ASSISTANT_CALL_MESSAGES = ("Passing `generation_config` together with generation-related arguments",
                           "`generation_config` default values have been modified to match model-specific defaults")


def generation_settings(sampling: SamplingConfig, max_new_tokens: int, eos_token_id) -> dict:
    """transformers' generation settings for our sampling: the same warped distribution as our
    engine (:data:`NEUTRAL` switches off what a checkpoint's generation_config.json could add),
    ``max_new_tokens`` and the EOS set (the first EOS id pads)."""
    eos = sorted(token_set(eos_token_id))
    settings = dict(NEUTRAL, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=eos or None,
                    pad_token_id=eos[0] if eos else 0, do_sample=not sampling.greedy)
    if not sampling.greedy:
        settings.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return settings


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ASSISTANT_CALL_MESSAGES)


@contextmanager
def quiet_assistant_calls(draft):
    """While active, ``draft.generate`` (called by transformers' assisted generation, once per
    round) runs with :data:`ASSISTANT_CALL_MESSAGES` dropped from transformers' generation log;
    every other message, and every message of the target's own ``generate``, passes."""
    log = logging.getLogger("transformers.generation.utils")
    drop = _DropMessages()
    own = draft.generate

    def generate(*args, **kwargs):
        log.addFilter(drop)
        try:
            return own(*args, **kwargs)
        finally:
            log.removeFilter(drop)

    draft.generate = generate
    try:
        yield
    finally:
        del draft.generate


class _RoundStreamer:
    """transformers streams the prompt first, then each round's accepted tokens plus one."""

    def __init__(self) -> None:
        self.puts: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(int(value.numel()))

    def end(self) -> None:
        pass


HF_MODES = ("constant", "heuristic", "confidence")


class HFAssisted:
    """The method ``hf_assisted`` (conf/method/hf_assisted.yaml): its settings, checked here before
    any model loads, and :meth:`runner` once they are loaded."""

    def __init__(self, mode: str = "constant", num_assistant_tokens: int = 20,
                 confidence_threshold: float = 0.4) -> None:
        if mode not in HF_MODES:
            raise ValueError(f"HFAssisted: mode must be one of {', '.join(HF_MODES)}, got {mode!r}")
        self.mode = mode
        self.num_assistant_tokens = check_count("HFAssisted", "num_assistant_tokens", num_assistant_tokens)
        self.confidence_threshold = check_threshold("HFAssisted", "confidence_threshold", confidence_threshold)

    def settings(self) -> dict:
        """The settings that change what runs (the threshold only in mode confidence)."""
        settings = {"mode": self.mode, "num_assistant_tokens": self.num_assistant_tokens}
        if self.mode == "confidence":
            settings["confidence_threshold"] = self.confidence_threshold
        return settings

    def runner(self, draft, target, sampling: SamplingConfig, profile: bool = False) -> HFAssistedRunner:
        return HFAssistedRunner(draft, target, sampling, **self.settings(), profile=profile)


class HFAssistedRunner(MethodRunner):

    def __init__(self, draft, target, sampling: SamplingConfig, mode: str, num_assistant_tokens: int,
                 confidence_threshold: float = 0.0, profile: bool = False) -> None:
        self.draft, self.target, self.sampling = draft, target, sampling
        self.assistant_settings = {
            "num_assistant_tokens": num_assistant_tokens,
            "num_assistant_tokens_schedule": "heuristic" if mode == "heuristic" else "constant",
            "assistant_confidence_threshold": confidence_threshold if mode == "confidence" else 0.0,
        }
        self.clock = Clock(target.device)  # wall time
        self.meter_clock = Clock(target.device, sync=profile)  # per forward: syncs only when profiling

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, seed: int, eos_token_id):
        for key, value in self.assistant_settings.items():
            setattr(self.draft.generation_config, key, value)
        from transformers import GenerationConfig

        config = GenerationConfig(**generation_settings(self.sampling, max_new_tokens, eos_token_id))
        streamer = _RoundStreamer()
        draft_meter = ForwardMeter(self.draft, self.meter_clock)
        candidate_lengths: list[int] = []
        seen = [0]

        def round_started():  # a target pass closes the drafting of one round
            candidate_lengths.append(draft_meter.calls - seen[0])
            seen[0] = draft_meter.calls

        torch.manual_seed(seed)  # transformers samples from the global generator
        with decode_attention(self.target.device), GatherKeptLogits(self.draft, self.target), \
                quiet_assistant_calls(self.draft), draft_meter, \
                ForwardMeter(self.target, self.meter_clock, on_call=round_started) as target_meter:
            t0 = self.clock.now()
            out = self.target.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                       assistant_model=self.draft, generation_config=config,
                                       streamer=streamer)
            wall = self.clock.now() - t0
        output_ids = out[0, prompt_ids.shape[1]:].tolist()
        accept_lengths = [n - 1 for n in streamer.puts[1:]]
        stats = RunStats(
            n_generated=len(output_ids), n_target_calls=target_meter.calls,
            n_draft_calls=draft_meter.calls,
            n_discarded=sum(candidate_lengths) - sum(accept_lengths),
            accept_lengths=accept_lengths, candidate_lengths=candidate_lengths,
            draft_time_s=draft_meter.seconds, target_time_s=target_meter.seconds, wall_time_s=wall)
        if not self.meter_clock.exact:
            stats.draft_time_s = stats.target_time_s = float("nan")
            return output_ids, stats, {"forward_time_s": None}
        return output_ids, stats, {"forward_time_s": draft_meter.seconds + target_meter.seconds}
