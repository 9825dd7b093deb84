"""transformers' own ``generate`` as a door to this project's decoding (docs/hf.md).

Two entries:

- :func:`generate`, a ``custom_generate`` callable::

      target.generate(input_ids, attention_mask=mask, custom_generate=specdecpp.hf.generate,
                      draft_model=draft, head="heads/next_wrej1_d1", threshold=0.5,
                      max_new_tokens=128, do_sample=True, temperature=0.8, top_k=50, top_p=0.95)

  ``generate`` prepares everything as usual (the generation config, the inputs, the logits
  processors, the stopping criteria) and hands it to this function, which decodes with a
  :class:`~specdecpp.decoders.chain.SpeculativeDecoder` (one prompt) or its ``generate_batch``
  (a left-padded batch, each row stopping its draft at its own K). transformers 4.56 passes the
  extra keywords (``draft_model=``, ``head=``, ...) only bound in the callable
  (``functools.partial(specdecpp.hf.generate, draft_model=draft, ...)``); later versions pass
  the keywords this function's signature names.
- :func:`hub_generate`, what the Hub folder ``hub/specdecpp-generate`` exposes as its
  ``custom_generate/generate.py``: it takes ``generate``'s raw arguments and re-enters
  ``GenerationMixin.generate`` with :func:`generate` bound to the streamer, the tokenizer's stop
  strings and the extra keywords, so the streamer and ``stop_strings`` work in every version.

How ``generate``'s preparation maps onto the decoders:

- The sampling warpers (temperature, top-k, top-p) become the project's
  :class:`~specdecpp.core.sampling.SamplingConfig` (``do_sample=False``: greedy), so the stop
  policies, the heads' fit checks and :func:`~specdecpp.core.sampling.warp` work as everywhere.
- Every other processor, from an allowlist of those that are pure functions of (prefix, scores)
  (:data:`PROCESSORS`), is applied to the target's and the draft's raw logits at every position,
  each position seeing its own prefix as ``generate`` would show it (left-padded to the batch's
  prompt width), before the warp: the output follows the target's processed distribution, as HF's
  assisted decoding promises. The stop policy reads the draft's raw logits (heads were trained on
  them). Anything else is refused with a ValueError naming its class.
- EOS (from ``EosTokenCriteria``, several ids allowed) and the length (``MaxLengthCriteria``) are
  the decoders' own; every other stopping criterion (stop strings, max time, the user's) is checked
  at each newly committed prefix in order, and the tokens after the first stop are cut.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .core.sampling import SamplingConfig
from .decoders.cascade import Cascade
from .decoders.chain import SpeculativeDecoder
from .decoders.rounds import CallHooks
from .models.fit import check_head_fit, config_hidden_size
from .models.loading import check_vocab, token_set
from .stopping.head import AcceptanceHead, load_head
from .stopping.policies import SpecDecPP, StopPolicy, TargetOnly, check_policy_keywords

# Processors applied position by position to both models' raw logits: pure functions of (prefix, scores).
PROCESSORS = (
    "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor", "ExponentialDecayLengthPenalty", "PrefixConstrainedLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
)
# The sampling warpers, in the order warp applies them, and what they set of a SamplingConfig.
WARPERS = {"TemperatureLogitsWarper": "temperature", "TopKLogitsWarper": "top_k", "TopPLogitsWarper": "top_p"}
NEUTRAL = ("LogitNormalization",)  # log-softmax: no distribution changes where it may stand (the end)
# The keywords of the two entries beyond generate's own (hub_generate binds them in the callable).
EXTRA_KEYWORDS = ("draft_model", "head", "threshold", "stop_policy", "cascade", "allow_draft_mismatch",
                  "allow_sampling_mismatch", "allow_label_mismatch", "fast", "capture_rounds")
# The model keywords generate hands a decoding method that the decoders make themselves.
MODEL_KWARGS = ("attention_mask", "position_ids", "cache_position", "use_cache", "logits_to_keep",
                "past_key_values", "cache", "output_attentions", "output_hidden_states")


def _output_class():
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    @dataclass
    class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
        """transformers' decoder-only output plus the run's stats: ``run_stats`` (one
        :class:`~specdecpp.decoders.rounds.RunStats` per row), ``tokens_per_target_call`` (tokens
        generated per target forward, over all rows) and ``acceptance_rate`` (accepted / drafted
        candidates, over all rows; NaN when nothing was drafted)."""

        run_stats: tuple | None = None
        tokens_per_target_call: float | None = None
        acceptance_rate: float | None = None

    return SpeculativeGenerateOutput


@functools.cache
def output_class() -> type:
    """The output type of ``return_dict_in_generate=True``: a subclass of transformers'
    ``GenerateDecoderOnlyOutput`` (built on first use, so importing this module stays cheap)."""
    return _output_class()


def _classes(names) -> dict:
    """transformers' classes of ``names`` that this version has, by class."""
    from transformers.generation import logits_process

    return {getattr(logits_process, n): n for n in names if hasattr(logits_process, n)}


def split_processors(logits_processor, do_sample: bool) -> tuple[list, SamplingConfig, list]:
    """``generate``'s prepared processors as ``(processors, sampling, warpers)``: the allowlisted
    processors to apply to both models' raw logits, the warpers' :class:`SamplingConfig` (greedy
    when not ``do_sample``) and the warper objects themselves (``output_scores``). Raises a
    ValueError naming any processor that cannot be applied so, or whose place in the list cannot be
    kept (a processor after a warper, warpers in another order than temperature, top-k, top-p)."""
    allowed, warpers, neutral = _classes(PROCESSORS), _classes(WARPERS), _classes(NEUTRAL)
    processors, kept_warpers, settings = [], [], {}
    order, last, normalized = list(WARPERS), -1, False
    for p in logits_processor or ():
        kind = type(p)
        if kind in allowed:
            if kept_warpers:
                raise ValueError(f"logits processor {kind.__name__} comes after the sampling warper "
                                 f"{type(kept_warpers[-1]).__name__} in generate's list; specdecpp.hf applies the "
                                 "processors before the warpers, so this order cannot be kept")
            processors.append(p)
        elif kind in warpers:
            name = warpers[kind]
            if normalized or order.index(name) <= last:
                raise ValueError(f"sampling warper {name} comes twice, after LogitNormalization or out of order in "
                                 "generate's list; specdecpp.hf samples with TemperatureLogitsWarper, then "
                                 "TopKLogitsWarper, then TopPLogitsWarper, once each")
            last = order.index(name)
            settings[WARPERS[name]] = _warper_setting(p, WARPERS[name])
            kept_warpers.append(p)
        elif kind in neutral:
            normalized = True
            kept_warpers.append(p)
        else:
            raise ValueError(
                f"logits processor {kind.__name__} is not supported by specdecpp.hf: it applies only processors "
                f"that are pure functions of the prefix and the scores ({', '.join(PROCESSORS)}) and the sampling "
                "settings temperature, top_k, top_p; drop it from the generate call (min_p, typical_p, epsilon/eta "
                "cutoffs, guidance_scale, watermarking and custom LogitsProcessor classes are refused)")
    sampling = SamplingConfig(**settings) if do_sample else SamplingConfig(temperature=0)
    return processors, sampling, kept_warpers


def drop_spent(processors: list, width: int) -> list:
    """``processors`` without those that change nothing at any prefix of at least ``width`` tokens
    (the call's padded prompt width): a minimum length already reached. ``generate`` builds them
    whenever ``min_length`` / ``min_new_tokens`` is set, e.g. to 0, and applying them at every
    position of both models costs time for nothing."""
    from transformers.generation.logits_process import (
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
    )

    def spent(p) -> bool:
        if type(p) is MinLengthLogitsProcessor:
            return width >= p.min_length
        if type(p) is MinNewTokensLengthLogitsProcessor:
            return width - p.prompt_length_to_skip >= p.min_new_tokens
        return False

    return [p for p in processors if not spent(p)]


def _warper_setting(p, key: str):
    """The SamplingConfig value of a warper that :func:`~specdecpp.core.sampling.warp` reproduces."""
    if getattr(p, "filter_value", -math.inf) != -math.inf:
        raise ValueError(f"{type(p).__name__} with filter_value={p.filter_value} is not supported (only -inf)")
    if key == "top_p" and getattr(p, "min_tokens_to_keep", 1) != 1:
        raise ValueError(f"TopPLogitsWarper with min_tokens_to_keep={p.min_tokens_to_keep} is not supported (only 1)")
    value = getattr(p, key)
    return int(value) if key == "top_k" else float(value)


def split_criteria(stopping_criteria) -> tuple[set[int], int | None, list]:
    """``generate``'s prepared stopping criteria as ``(eos ids, max_length, others)``: EOS and the
    maximum length are the decoders' own; the others are checked at each committed prefix."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    eos, max_length, others = set(), None, []
    for c in stopping_criteria or ():
        if type(c) is EosTokenCriteria:
            eos |= token_set(c.eos_token_id)
        elif type(c) is MaxLengthCriteria:
            max_length = c.max_length if max_length is None else min(max_length, c.max_length)
        else:
            others.append(c)
    return eos, max_length, others


class Rows:
    """The call's rows as ``generate`` shows them to processors and stopping criteria: row i is the
    batch's left-padded prompt ``input_ids[i]`` (width L) followed by its generated tokens; the
    decoders hold each prompt unpadded (``prompt_lens[i]`` tokens) followed by the same tokens."""

    def __init__(self, input_ids: torch.Tensor, prompt_lens: list[int], processors: list, criteria: list) -> None:
        self.input_ids, self.prompt_lens = input_ids, prompt_lens
        self.processors, self.criteria = processors, criteria
        self.batch = input_ids.shape[0]

    def matrices(self, rows: list[int], tokens: list[torch.Tensor], ends: list[int]):
        """Yield ``(members, ids)``: ``ids`` [B, L + g] holds each member r's prefix ``tokens[r][:ends[r]]`` at its
        row ``rows[r]`` as generate shows it (members share g generated tokens and no row); the other rows
        repeat the first member's (generate's rows run on after their end too; their answers are unused)."""
        groups: dict[int, list[list[int]]] = {}
        for r, (row, end) in enumerate(zip(rows, ends, strict=True)):
            buckets = groups.setdefault(end - self.prompt_lens[row], [])
            bucket = next((b for b in buckets if all(rows[m] != row for m in b)), None)
            if bucket is None:
                buckets.append(bucket := [])
            bucket.append(r)
        for g, buckets in groups.items():
            for members in buckets:
                generated = torch.stack([tokens[r][self.prompt_lens[rows[r]] : ends[r]] for r in members])
                tail = generated[:1].expand(self.batch, g).clone()
                tail[[rows[r] for r in members]] = generated
                yield members, torch.cat([self.input_ids, tail.to(self.input_ids.device)], dim=1)

    def process(self, rows: list[int], tokens: list[torch.Tensor], ends: list[int],
                logits: torch.Tensor) -> torch.Tensor:
        """The processors on logits rows [R, V] (each after its row's prefix), in float32 as generate runs them."""
        out = logits.float().clone()
        for members, ids in self.matrices(rows, tokens, ends):
            at = [rows[r] for r in members]
            scores = out[members[0]].expand(self.batch, -1).clone()
            scores[at] = out[members]
            for p in self.processors:
                scores = p(ids.to(scores.device), scores)
            out[members] = scores[at]
        return out

    def stop(self, row: int, tokens: torch.Tensor, start: int, count: int) -> int | None:
        """The first i < count whose prefix ``tokens[:start + i + 1]`` a criterion ends, else None."""
        for i in range(count):
            (_, ids), = self.matrices([row], [tokens], [start + i + 1])
            if any(bool(c(ids, None)[row]) for c in self.criteria):
                return i
        return None


class ScoreRecorder:
    """``output_scores`` / ``output_logits``: the target's rows of every position, by row and
    position (a later round's rows for a position replace a discarded round's)."""

    def __init__(self, process) -> None:
        self.process, self.raw, self.scores = process, {}, {}

    def __call__(self, rows, tokens, ends, logits):
        done = logits if self.process is None else self.process(rows, tokens, ends, logits)
        for r, (row, end) in enumerate(zip(rows, ends, strict=True)):
            self.raw[(row, end)], self.scores[(row, end)] = logits[r].float(), done[r].float()
        return done


def _callers_streamer():
    """The streamer of the transformers ``generate`` call that called :func:`generate` directly:
    transformers >= 4.57 hands a ``custom_generate`` callable no streamer (it has put the prompt in
    already). None when the caller is not transformers' ``generate`` or has no streamer."""
    try:
        from transformers.generation.utils import GenerationMixin

        code = inspect.unwrap(GenerationMixin.generate).__code__
        frame = sys._getframe(2)  # this <- generate (ours) <- the caller
    except (ImportError, AttributeError, ValueError):
        return None
    return frame.f_locals.get("streamer") if frame.f_code is code else None


def loaded_head(ref: str) -> AcceptanceHead:
    """``load_head(ref)``, kept for later calls while a local head's files are unchanged (a hub id: for
    the process), so a call pays no loading (nor a hub lookup) for a head it used before."""
    path = Path(ref).expanduser()
    stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(path.iterdir()) if f.is_file()) \
        if path.is_dir() else None
    return _load_head(ref, stamp)


@functools.lru_cache(maxsize=16)
def _load_head(ref: str, stamp) -> AcceptanceHead:
    return load_head(ref)


def resolve_policy(model, draft_model, head, threshold, stop_policy, sampling: SamplingConfig,
                   cascade: Cascade | None, allowed: dict) -> tuple[StopPolicy, object]:
    """The stop policy and the draft of a call: ``stop_policy`` as given, or SpecDec++ with ``head``
    (a directory, a hub id or a loaded head) at ``threshold``; a head is checked against the draft,
    the sampling and the rule (``specdecpp.models.fit``)."""
    check_policy_keywords("specdecpp.hf.generate", head, threshold, stop_policy)
    if head is not None:
        if isinstance(head, AcceptanceHead):
            artifact = "head"
        elif isinstance(head, str) or hasattr(head, "__fspath__"):
            artifact = f"head {str(head)!r}"
            head = loaded_head(str(head))
        else:
            raise TypeError(f"head must be a head directory, a hub id or a specdecpp AcceptanceHead, got "
                            f"{type(head).__name__}")
        stop_policy = SpecDecPP(head, **({} if threshold is None else {"threshold": threshold}))
    elif stop_policy is None:
        raise ValueError("specdecpp.hf.generate needs a stop rule: head='path-or-hub-id' (SpecDec++, with "
                         "threshold=...) or stop_policy=SVIP(...) / FixedK(...) / TargetOnly()")
    else:
        artifact = "stop_policy's head"
    if not isinstance(stop_policy, StopPolicy):
        raise TypeError(f"stop_policy must be a specdecpp StopPolicy (FixedK, SVIP, SpecDecPP, TargetOnly), got "
                        f"{type(stop_policy).__name__}")
    if draft_model is None:
        if not isinstance(stop_policy, TargetOnly):
            raise ValueError("specdecpp.hf.generate needs draft_model=... (the draft model, loaded, on the target's "
                             "device); only stop_policy=TargetOnly() decodes without one")
        draft_model = model
    if isinstance(stop_policy, SpecDecPP):
        name = getattr(draft_model.config, "_name_or_path", "") or ""
        check_head_fit(artifact, stop_policy.head, name or type(draft_model).__name__,
                       config_hidden_size(draft_model.config), sampling,
                       None if cascade is None else {"rule": cascade.rule, "alpha": cascade.alpha},
                       allowed=allowed, compare_names=bool(name))
    return stop_policy, draft_model


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Each row's prompt length: its mask's ones, which must be the row's right end (left padding)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, length] with length >= 1, got {tuple(input_ids.shape)}")
    if attention_mask is None:
        return [input_ids.shape[1]] * input_ids.shape[0]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
                         f"{tuple(input_ids.shape)}")
    mask = attention_mask.bool()
    lengths = mask.sum(1).tolist()
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"row {i} of attention_mask is all zeros: every row needs at least one prompt token")
        if not bool(mask[i, mask.shape[1] - n :].all()):
            raise ValueError(f"row {i} of attention_mask is not left-padded (zeros after ones): pad on the left "
                             "(tokenizer.padding_side='left'), as decoder-only generation needs")
    return lengths


def _pad_token(generation_config) -> int | None:
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None:
        pad = generation_config.pad_token_id
    if isinstance(pad, torch.Tensor):
        pad = pad.reshape(-1)[0] if pad.numel() else None
    elif isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    return None if pad is None else int(pad)


def _check_call(generation_config, synced_gpus, model_kwargs: dict) -> None:
    """What this door refuses of a generate call, each named."""
    unknown = sorted(k for k, v in model_kwargs.items() if k not in MODEL_KWARGS and v is not None)
    if unknown:
        raise ValueError(f"specdecpp.hf.generate does not take the model inputs {unknown}: it decodes token ids "
                         "(input_ids and attention_mask) of a decoder-only model")
    cache = model_kwargs.get("past_key_values", model_kwargs.get("cache"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise ValueError("specdecpp.hf.generate starts from the prompt: a prefilled cache (past_key_values) is not "
                         "supported")
    if synced_gpus:
        raise ValueError("specdecpp.hf.generate does not support synced_gpus=True")
    for key in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, key, False) or model_kwargs.get(key):
            raise ValueError(f"specdecpp.hf.generate does not support {key}=True (output_scores and output_logits "
                             "are supported)")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(f"specdecpp.hf.generate samples or decodes greedily; num_beams={generation_config.num_beams} "
                         "(beam search) is not supported")


def generate(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
             generation_config=None, synced_gpus: bool = False, streamer=None, draft_model=None, head=None,
             threshold: float | None = None, stop_policy: StopPolicy | None = None, cascade: Cascade | None = None,
             tokenizer=None, allow_draft_mismatch: bool = False, allow_sampling_mismatch: bool = False,
             allow_label_mismatch: bool = False, fast: str | None = None, capture_rounds: bool | str = True,
             **model_kwargs):
    """Speculative decoding under a learned (or any) stop policy as transformers' ``custom_generate``
    callable: ``target.generate(..., custom_generate=specdecpp.hf.generate, draft_model=draft,
    head="dir-or-hub-id", threshold=0.5)`` (or ``stop_policy=SVIP(...)`` / ``FixedK(...)`` /
    ``TargetOnly()``). docs/hf.md lists what is supported and what is refused.

    ``model`` is the target; ``draft_model`` the draft (loaded, on the target's device, the same
    vocabulary); ``head`` a SpecDec++ head directory, hub id or loaded head, checked against the
    draft, the sampling and the rule (``allow_*_mismatch=True`` accepts a mismatch, as infer's
    ``method.allow_*_mismatch``); ``cascade`` a :class:`~specdecpp.decoders.cascade.Cascade` makes
    decoding lossy (opt-in; refused with processors other than the sampling settings); ``fast`` and
    ``capture_rounds`` (``"fused"``: with ``fast="compile-graphs"``, a captured round's draws and rule
    compiled too) as :class:`~specdecpp.decoders.chain.SpeculativeDecoder`'s; ``tokenizer``: checked
    to fit both models. Sampling uses torch's global RNG (seed with ``torch.manual_seed``).

    Returns ``sequences`` [B, L + longest] (rows padded with ``pad_token_id`` after their end), or with
    ``return_dict_in_generate=True`` a :func:`output_class` with the run's stats."""
    if streamer is None:
        streamer = _callers_streamer()
    try:
        call = GenerateCall(logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                            generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer)
        options = SpeculativeOptions(draft_model=draft_model, head=head, threshold=threshold, stop_policy=stop_policy,
                                     cascade=cascade, tokenizer=tokenizer, fast=fast, capture_rounds=capture_rounds,
                                     allowed={"draft": allow_draft_mismatch, "sampling": allow_sampling_mismatch,
                                              "label": allow_label_mismatch})
        return _generate(model, input_ids, call, options, model_kwargs)
    finally:
        if streamer is not None:
            streamer.end()  # also after an error: a TextIteratorStreamer's reader must not wait forever


@dataclass(frozen=True)
class GenerateCall:
    """The arguments transformers' ``generate`` hands a ``custom_generate`` callable."""

    logits_processor: Any = None
    stopping_criteria: Any = None
    generation_config: Any = None
    synced_gpus: bool = False
    streamer: Any = None


@dataclass(frozen=True)
class SpeculativeOptions:
    """What :func:`generate` adds to them: the draft, the stop policy (a head and its threshold, or a
    policy), a cascade, the tokenizer to check, the mismatches allowed and the fast path."""

    draft_model: Any = None
    head: Any = None
    threshold: float | None = None
    stop_policy: StopPolicy | None = None
    cascade: Cascade | None = None
    tokenizer: Any = None
    allowed: dict = field(default_factory=dict)
    fast: str | None = None
    capture_rounds: bool | str = True


def _generate(model, input_ids, call: GenerateCall, options: SpeculativeOptions, model_kwargs: dict):
    generation_config = call.generation_config if call.generation_config is not None else model.generation_config
    streamer, cascade = call.streamer, options.cascade
    _check_call(generation_config, call.synced_gpus, model_kwargs)
    processors, sampling, warpers = split_processors(call.logits_processor, bool(generation_config.do_sample))
    if cascade is not None and processors:
        raise ValueError(f"cascade=... reads the models' raw logits; it cannot run with the logits processors "
                         f"{[type(p).__name__ for p in processors]}")
    policy, draft = resolve_policy(model, options.draft_model, options.head, options.threshold, options.stop_policy,
                                   sampling, cascade, options.allowed)
    if options.tokenizer is not None:
        for name, m in (("draft_model", draft), ("the target", model)):
            check_vocab(m, options.tokenizer, name)
    eos, max_length, criteria = split_criteria(call.stopping_criteria)
    device = model.device
    input_ids = input_ids.to(device)
    batch, width = input_ids.shape if input_ids.dim() == 2 else (None, None)
    mask = model_kwargs.get("attention_mask")
    lengths = prompt_rows(input_ids, None if mask is None else mask.to(device))
    pad = _pad_token(generation_config)
    if batch > 1 and pad is None:
        raise ValueError("a batch (input_ids with more than one row) needs a pad token to pad the finished rows: set "
                         "pad_token_id=... (or the model's generation_config.pad_token_id, or an eos_token_id)")
    if batch > 1 and streamer is not None:
        raise ValueError("a streamer takes one row: decode a batch without streamer=")
    max_length = max_length if max_length is not None else generation_config.max_length
    max_new = (max_length - width) if max_length is not None else None
    if max_new is None:
        raise ValueError("give max_new_tokens=... or max_length=...")
    processors = drop_spent(processors, width)
    rows = Rows(input_ids, lengths, processors, criteria)
    record = bool(generation_config.return_dict_in_generate and
                  (generation_config.output_scores or generation_config.output_logits))
    target_process = rows.process if processors else None
    recorder = ScoreRecorder(target_process) if record else None
    hooks = CallHooks(draft_logits=rows.process if processors else None,
                      target_logits=recorder if recorder is not None else target_process,
                      stop=rows.stop if criteria else None,
                      committed=(lambda row, new: streamer.put(new.cpu())) if streamer is not None else None)
    if max_new < 1:
        outputs = []
    else:
        decoder = SpeculativeDecoder(draft, model, policy, sampling, cascade=cascade, fast=options.fast,
                                     capture_rounds=options.capture_rounds)
        prompts = [input_ids[i, width - n :] for i, n in enumerate(lengths)]
        if batch == 1:
            outputs = [decoder.generate(prompts[0].unsqueeze(0), max_new, eos_token_id=eos, hooks=hooks)]
        else:
            outputs = decoder.generate_batch(prompts, max_new, eos_token_id=eos, hooks=hooks)
    generated = [out.tokens[0, n:] for out, n in zip(outputs, lengths, strict=False)]
    longest = max((g.shape[0] for g in generated), default=0)
    sequences = torch.full((batch, width + longest), pad if pad is not None else 0, dtype=input_ids.dtype,
                           device=device)
    sequences[:, :width] = input_ids
    for i, g in enumerate(generated):
        sequences[i, width : width + g.shape[0]] = g
    if not generation_config.return_dict_in_generate:
        return sequences
    stats = tuple(out.stats for out in outputs)
    scores = logits = None
    if record:
        scores, logits = _recorded(recorder, warpers, input_ids, lengths, generated, longest, generation_config)
    return output_class()(sequences=sequences, scores=scores, logits=logits, run_stats=stats,
                          tokens_per_target_call=_ratio(sum(s.n_generated for s in stats),
                                                        sum(s.n_target_calls for s in stats)),
                          acceptance_rate=_ratio(sum(sum(s.accept_lengths) for s in stats),
                                                 sum(sum(s.candidate_lengths) for s in stats)))


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _recorded(recorder: ScoreRecorder, warpers: list, input_ids, lengths, generated, longest, generation_config):
    """``scores`` (the processed target rows through the warpers, as generate's ``scores``) and ``logits`` (the
    raw rows) per step, [B, V] each; a row that ended earlier holds zeros."""
    vocab = next(iter(recorder.raw.values())).shape[-1] if recorder.raw else 0
    scores, logits = [], []
    for t in range(longest):
        s_t = input_ids.new_zeros((len(lengths), vocab), dtype=torch.float32)
        l_t = s_t.clone()
        for i, (n, g) in enumerate(zip(lengths, generated, strict=True)):
            if t < g.shape[0]:
                s = recorder.scores[(i, n + t)].unsqueeze(0)
                for w in warpers:
                    s = w(input_ids[i : i + 1], s)
                s_t[i], l_t[i] = s[0], recorder.raw[(i, n + t)]
        scores.append(s_t)
        logits.append(l_t)
    return (tuple(scores) if generation_config.output_scores else None,
            tuple(logits) if generation_config.output_logits else None)


def hub_generate(*args, model=None, **kwargs):
    """The Hub folder's ``generate`` (``hub/specdecpp-generate/custom_generate/generate.py``):
    ``target.generate(custom_generate="dir-or-org/repo", trust_remote_code=True, draft_model=draft,
    head=..., streamer=..., stop_strings=[...], tokenizer=tok, ...)`` calls it with ``generate``'s raw
    arguments (``model=`` the target). It re-enters ``GenerationMixin.generate`` with :func:`generate`
    as the callable, bound to the extra keywords, the streamer and the tokenizer, so ``generate``'s
    preparation is reused in every transformers version; the stop strings become a
    ``StopStringCriteria`` here (transformers >= 4.57 builds none for a callable). Also callable
    directly: ``hub_generate(target, input_ids, draft_model=draft, ...)``."""
    from transformers import GenerationMixin
    from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

    if model is None:
        if not args:
            raise ValueError("hub_generate needs the target model (model=... or the first argument)")
        model, args = args[0], args[1:]
    extras = {k: kwargs.pop(k) for k in EXTRA_KEYWORDS if k in kwargs}
    streamer, tokenizer = kwargs.pop("streamer", None), kwargs.pop("tokenizer", None)
    config = kwargs.get("generation_config")
    stop_strings = kwargs.pop("stop_strings", None)
    if stop_strings is None:
        stop_strings = (config if config is not None else model.generation_config).stop_strings
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=... to generate")
        kwargs["stopping_criteria"] = StoppingCriteriaList(
            [*(kwargs.get("stopping_criteria") or ()),
             StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)])
        if config is not None and config.stop_strings:  # a copy without them
            config = kwargs["generation_config"] = copy.deepcopy(config)
            config.stop_strings = None
        elif config is None and model.generation_config.stop_strings:
            kwargs["stop_strings"] = None  # not the model's own either
    bound, started = functools.partial(generate, streamer=streamer, tokenizer=tokenizer, **extras), []

    @functools.wraps(generate)
    def call(*call_args, **call_kwargs):
        started.append(True)  # from here on generate ends the streamer
        return bound(*call_args, **call_kwargs)

    try:
        return GenerationMixin.generate(model, *args, streamer=streamer, custom_generate=call, **kwargs)
    except BaseException:
        if streamer is not None and not started:  # generate failed before the decoding (e.g. its prompt put)
            streamer.end()
        raise
