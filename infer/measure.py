"""Measurements of a draft/target pair, what ``python -m infer.costs`` runs (docs there): per-forward
costs through the decoding engine's own model calls (``specdecpp.core.timing.time_forwards``), the
per-token acceptance alpha and the fixed-K speedup of Eq. 2.3."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from specdecpp import SamplingConfig, load_pair, warp
from specdecpp.analysis.costmodel import Costs, fixed_k_speedup
from specdecpp.core.attention import decode_attention
from specdecpp.core.compat import cache_kwargs
from specdecpp.core.sampling import sample
from specdecpp.core.timing import time_forwards
from specdecpp.data.prompts import encode_prompt, load_prompts
from specdecpp.models.loading import dtype_name, load_model, resolve_dtype
from specdecpp.models.reduced_vocab import ReducedOutput, output_vocab_size

SAMPLING = SamplingConfig(temperature=1.0, top_k=50)


def sample_response(target, prompt_ids: list[int], max_new_tokens: int, eos_token_id, seed: int) -> torch.Tensor:
    """prompt + a response sampled from the target's warped distribution: LongTensor [1, L + n]."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids], device=target.device)
    with torch.no_grad():
        out = target(ids, use_cache=True)
        cache = out.past_key_values
        for _ in range(max_new_tokens):
            probs = warp(out.logits[:, -1].float(), SAMPLING).cpu()  # drawn on the CPU: one generator anywhere
            token = sample(probs, generator).unsqueeze(-1).to(ids.device)
            ids = torch.cat([ids, token], dim=1)
            if eos_token_id is not None and token.item() == eos_token_id:
                break
            out = target(token, use_cache=True, **cache_kwargs(target, cache))
    return ids


def position_acceptance(draft, target, ids: torch.Tensor, prompt_len: int,
                        depths: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha_i = sum_v min(p_i(v), q_i(v)) at each response position i, and the target's mass
    p_i(S) on the draft's output set S (1 for a full-vocabulary draft). A feature draft's q at
    depth d (a round's d-th candidate, :func:`specdecpp.data.labels.feature_draft_logits`): alpha
    [N, depths] then, column 0 the first candidate's (NaN where the prompt is too short for d)."""
    from specdecpp.data.labels import feature_draft_logits
    from specdecpp.models.feature_draft import FeatureDraft

    with torch.no_grad():
        p = warp(target(ids[:, :-1]).logits[0, prompt_len - 1:], SAMPLING)
        if isinstance(draft, FeatureDraft):
            prompt, response = ids[0, :prompt_len].tolist(), ids[0, prompt_len:].tolist()
            at = feature_draft_logits(draft, target, [prompt], [response], p.shape[-1], depths)
            alpha = torch.stack([torch.minimum(p, warp(at(0, d, 0, len(response)).to(p.device), SAMPLING)).sum(-1)
                                 for d in range(1, depths + 1)], dim=1)
            return alpha if depths > 1 else alpha[:, 0], p[:, draft.token_ids.to(p.device)].sum(-1)
        q = warp(draft(ids[:, :-1]).logits[0, prompt_len - 1:, : p.shape[-1]], SAMPLING)
    layer = draft.get_output_embeddings()
    covered = (p[:, layer.token_ids].sum(-1) if isinstance(layer, ReducedOutput)
               else torch.ones(p.shape[0], device=p.device))
    return torch.minimum(p, q).sum(-1), covered


FEATURE_DEPTHS = 4  # a feature draft's acceptance is measured at depths 1..4 of a round


def _feature_draft_calls(draft, target, context: torch.Tensor, tail: torch.Tensor, widths: list[int]):
    """A feature draft's timed call: one drafting step (one token on its own previous output, over
    a cache of the context read on the target's features), what a round's candidates after the
    first cost; its reset rolls the cache back. Only width 1: trees and batches refuse it."""
    if any(w != 1 for w in widths):
        raise ValueError("a feature draft is timed at width 1 only (token trees do not take it yet); "
                         "give --max-width 1 for its draft curve or measure the target alone")
    ids = context[0].to(draft.device)
    cache = draft.new_cache()
    with torch.no_grad():
        feats = draft.fuse(target(ids[None], output_hidden_states=True).hidden_states)
        out = draft(ids[None, 1:], features=feats[:, :-1], cache=cache, n_logits=1)
    length, hidden = cache.length, out.hidden[:, -1:]
    return ((lambda: draft(tail[None, :1], hidden=hidden, cache=cache, n_logits=1)),
            (lambda: cache.rollback(length)))


def step_times(models: dict, context: torch.Tensor, steps: int, widths: dict[str, list[int]] | None = None,
               fast: str | None | dict = None) -> dict[str, dict[int, float]]:
    """Median seconds of one cached forward of n tokens per model (n = 1 and ``widths[name]``),
    batch 1, through the decoding engine's own model call (``specdecpp.models.runner.ModelRunner.feed``: on a
    CPU it pads 2-3 tokens to 4, as decoding does; with ``fast``, the static runner's, which pads n
    to its width bucket and compiles each bucket once, before timing; a dict gives each model name
    its own backend, so eager and fast are timed in one loop), the cache rolled back after each
    (untimed); every (model, n) in turn in each step (``specdecpp.core.timing.time_forwards``), so
    machine load affects all alike."""
    from specdecpp.fast.calls import CallRunners

    widths = widths or {}
    calls, resets = {}, {}
    backends = fast if isinstance(fast, dict) else dict.fromkeys(models, fast)
    runners = {b: CallRunners(b, models.values(), cover=False)  # each width timed in its own bucket
               for b in {backends.get(name) for name in models}}
    from specdecpp.models.feature_draft import FeatureDraft

    with torch.no_grad():
        for name, model in models.items():
            tail_len = max([9, *[w + 1 for ws in widths.values() for w in ws]])
            if isinstance(model, FeatureDraft):
                if backends.get(name) is not None:
                    raise ValueError("a feature draft keeps its own eager runner on the fast path (its target's steps "
                                     "are compiled, specdecpp.fast.features): time the draft with fast=None")
                target = next(m for m in models.values() if not isinstance(m, FeatureDraft))
                call, reset = _feature_draft_calls(model, target, context[:, :-tail_len],
                                                   context[0, -tail_len:].to(model.device), [1])
                calls[(name, 1)], resets[(name, 1)] = call, reset
                continue
            runner = runners[backends.get(name)](context.shape[1])(model, output_vocab_size(model), False)
            runner.feed(context[0, :-tail_len].to(model.device))
            length, tail = runner.length, context[0, -tail_len:].to(model.device)
            for n in [1, *[w for w in widths.get(name, []) if w != 1]]:
                calls[(name, n)] = (lambda r=runner, t=tail[:n], n=n: r.feed(t, n_logits=n))
                resets[(name, n)] = (lambda r=runner, length=length: r.rollback(length))
        with decode_attention(next(iter(models.values())).device):  # the kernels decoding uses
            timed = time_forwards(calls, repeats=steps, warmup=3, resets=resets)
    out: dict[str, dict[int, float]] = {}
    for (name, n), t in timed.items():
        out.setdefault(name, {})[n] = t.median
    return out


def batch_times(draft, target, context: list[int], sizes: list[int], widths: list[int], repeats: int,
                fast: str | None = None) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
    """t_draft(B) (one token per row) and t_target(B, n) (n tokens per row): medians of the batched
    engine's forwards (``specdecpp.decoders.batch.BatchRunner.feed``, or with ``fast`` the static
    batch runner's, which pads B to its batch bucket and n to its width bucket and compiles or
    captures each (B, n) bucket on its first, untimed, forward) after ``context`` cached in every
    row, the cache rolled back and compacted after each (untimed); every (model, B, n) in turn in
    each step (``specdecpp.core.timing.time_forwards``), so machine load affects all alike."""
    from specdecpp.decoders.batch import BatchRunner
    from specdecpp.fast.buckets import fit_buckets
    from specdecpp.fast.calls import CallRunners

    tail_len = max(widths) + 1
    if len(context) <= tail_len:
        raise ValueError(f"batch_times: a context of {len(context)} tokens is too short for widths up to {max(widths)}")
    calls, resets = {}, {}
    runners = CallRunners(fast, (draft, target), cover=False)  # each (B, n) timed in its own bucket
    for name, model, ws in (("draft", draft, [1]), ("target", target, widths)):
        for b in sizes:
            make = runners.batch(len(context), fit_buckets(max(ws)), rows=b, eager=BatchRunner)
            runner = make(model, output_vocab_size(model), False)
            with torch.no_grad():
                runner.add_rows([torch.tensor(context[:-tail_len], device=model.device)] * b)
            tail, length = torch.tensor(context[-tail_len:], device=model.device), runner.lengths[0]
            for n in ws:
                calls[(name, b, n)] = (lambda r=runner, t=tail[:n], b=b: r.feed([t] * b, n_logits=t.shape[0]))
                resets[(name, b, n)] = (lambda r=runner, length=length, b=b: (r.rollback([length] * b), r.compact()))
    with torch.no_grad(), decode_attention(target.device):  # the kernels decoding uses
        timed = time_forwards(calls, repeats=repeats, warmup=2, resets=resets)
    return ({b: timed[("draft", b, 1)].median for b in sizes},
            {b: {n: timed[("target", b, n)].median for n in widths} for b in sizes})


def measured_widths(max_width: int) -> list[int]:
    """The widths the cost curves are timed at: 1..8, then 12, 16, 24, 32, 48, 64, 96, ... up to
    ``max_width``."""
    out, n = list(range(1, min(max_width, 8) + 1)), 8
    while True:
        for m in (n * 3 // 2, n * 2):
            if m > max_width:
                return out
            out.append(m)
        n *= 2


@dataclass(frozen=True)
class MeasureConfig:
    """What ``python -m infer.costs`` measures of a pair and how (its command-line settings, built
    from them in ``infer.costs.main``)."""

    sources: tuple[str, ...]            # prompt sources (their test split) for the acceptance
    limit: int                          # prompts per source
    max_new_tokens: int                 # tokens of each sampled response
    timing_steps: int                   # timed repeats of each forward
    seed: int                           # response i is sampled from seed + i
    dtype: str = "fast"                 # precision of both models
    compare_dtypes: tuple[str, ...] = ()  # also timed, the same pair at these precisions, in the same loop
    device: str = "cpu"
    max_width: int = 8                  # both width curves up to this many tokens at once
    batch_sizes: tuple[int, ...] = ()   # also t_draft(B), t_target(B, n) at these batch sizes
    fast: str | None = None             # the fast path's backend the forwards are timed on (None: eager)


def measure(draft_path: str, target_path: str, config: MeasureConfig) -> dict:
    """Acceptance, per-forward costs and the fixed-K speedups of the pair (``config``: what and how)."""
    c = config
    from specdecpp.models.feature_draft import FeatureDraft

    draft, target, tokenizer = load_pair(draft_path, target_path, device=c.device, dtype=c.dtype)
    feature = isinstance(draft, FeatureDraft)
    if feature and (c.batch_sizes or c.compare_dtypes):
        raise ValueError("a feature draft is measured batch 1, at its own precision: --batch-sizes and "
                         "--compare-dtype do not take it yet (docs/feature_draft.md)")
    per_source, depth_info = {}, {}
    for source in c.sources:
        split = "test"
        prompts = load_prompts(source, split=split, limit=c.limit)
        alphas, covers, n_tokens, by_depth = [], [], 0, []
        for i, prompt in enumerate(tqdm(prompts, desc=f"acceptance on {source}/{split}")):
            prompt_ids = encode_prompt(tokenizer, prompt.prompt)
            ids = sample_response(target, prompt_ids, c.max_new_tokens, tokenizer.eos_token_id, c.seed + i)
            alpha, covered = position_acceptance(draft, target, ids, len(prompt_ids),
                                                 FEATURE_DEPTHS if feature else 1)
            if feature:
                by_depth.append(alpha)
                alpha = alpha[:, 0]
            alphas.append(alpha)
            covers.append(covered)
            n_tokens += alpha.numel()
        alpha = torch.cat(alphas)
        if feature:
            deep = torch.cat(by_depth)
            depth_info[source] = [float(deep[:, d].nanmean()) for d in range(deep.shape[1])]
        per_source[source] = {"split": split, "prompts": len(prompts), "positions": n_tokens,
                              "acceptance": alpha.mean().item(), "target_mass_covered": torch.cat(covers).mean().item(),
                              "acceptance_per_prompt_std": (torch.stack([a.mean() for a in alphas]).std().item()
                                                             if len(alphas) > 1 else float("nan"))}
    context = sample_response(target, encode_prompt(tokenizer, load_prompts(c.sources[0], "test", 1)[0].prompt),
                              64 + max(0, c.max_width - 8), None, c.seed)  # a mid-generation cache, 64 tokens in
    models = {"draft": draft, "target": target}
    others = ({dtype_name(d) for d in (resolve_dtype(x, draft.device) for x in c.compare_dtypes)}
              - {dtype_name(target.dtype)})
    for name in sorted(others):  # the same pair at another precision, timed in the same loop
        models[f"draft@{name}"] = load_model(draft_path, str(target.device), name)
        models[f"target@{name}"] = load_model(target_path, str(target.device), name)
    widths = measured_widths(c.max_width)
    # a feature draft keeps its eager runner on the fast path (specdecpp.fast.features): only its target takes --fast
    backends = {"draft": None, "target": c.fast} if feature and c.fast else c.fast
    timed = step_times(models, context, c.timing_steps,
                       {name: [1] if feature and name == "draft" else widths for name in models}, backends)
    times = {name: t[1] for name, t in timed.items()}
    compare = {name: {"draft_step_s": times[f"draft@{name}"], "target_step_s": times[f"target@{name}"],
                      "cost_ratio": times[f"draft@{name}"] / times[f"target@{name}"],
                      "target_by_width_s": timed[f"target@{name}"]} for name in sorted(others)}
    batched = {}
    if c.batch_sizes:  # t_draft(B), t_target(B, n) for batched decoding (generate_batch), in a loop of their own
        bw = [n for n in widths if n <= 21]
        by_draft, by_target = batch_times(draft, target, context[0].tolist(), sorted({1, *c.batch_sizes}), bw,
                                          c.timing_steps, c.fast)
        batched = {"draft_by_batch_s": by_draft, "target_by_batch_s": by_target}
    ratio = times["draft"] / times["target"]
    overall = sum(s["acceptance"] * s["positions"] for s in per_source.values()) / sum(
        s["positions"] for s in per_source.values())
    speedups = {k: fixed_k_speedup(overall, ratio, k) for k in range(1, 21)}
    best_k = max(speedups, key=speedups.get)
    return {"draft": draft_path, "target": target_path, "dtype": dtype_name(target.dtype), "device": str(target.device),
            "compare_dtypes": compare, "sampling": SAMPLING.to_dict(), "fast": c.fast,
            "max_new_tokens": c.max_new_tokens, "seed": c.seed, "threads": torch.get_num_threads(),
            "per_source": per_source, "acceptance": overall,
            "draft_step_s": times["draft"], "target_step_s": times["target"], "cost_ratio": ratio,
            "target_by_width_s": timed["target"], "draft_by_width_s": timed["draft"],
            "draft_output_vocab": output_vocab_info(draft),
            "fixed_k_speedup": speedups, "best_k": best_k, "best_fixed_k_speedup": speedups[best_k], **batched,
            **({"acceptance_by_depth": depth_info} if feature else {})}


def output_vocab_info(draft) -> dict:
    from specdecpp.models.feature_draft import FeatureDraft

    if isinstance(draft, FeatureDraft):
        return {"scored_tokens": int(draft.draft_vocab_size), "vocab_size": int(draft.vocab_size)}
    layer = draft.get_output_embeddings()
    scored = int(layer.token_ids.numel()) if isinstance(layer, ReducedOutput) else int(layer.weight.shape[0])
    return {"scored_tokens": scored, "vocab_size": output_vocab_size(draft)}


def pair_costs(result: dict) -> Costs:
    """The cost model's view of a measurement: what ``--costs-out`` writes."""
    meta = {k: result.get(k) for k in ("draft", "target", "device", "dtype", "threads", "fast")}
    return Costs(result["draft_step_s"], result["target_step_s"], dict(result["target_by_width_s"]),
                 {**meta, "measured_by": "python -m infer.costs"},
                 draft_by_width=dict(result.get("draft_by_width_s") or {}) or None,
                 target_by_batch=result.get("target_by_batch_s"), draft_by_batch=result.get("draft_by_batch_s"))
