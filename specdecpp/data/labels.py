"""Training labels for acceptance heads (SpecDec++ Section 3.3), batched over prompts.

For each prompt x:
  1. sample a response X_1..X_N from the TARGET's warped distribution (:func:`sample_responses`);
  2. one DRAFT forward over x + X gives q_i = q(.|x, X_<i) for every i; draw Y_i ~ q_i;
  3. p_i is the target distribution X_i was sampled from (kept while sampling, on its top-k /
     top-p support: :func:`sample_responses_with_probs`), or one TARGET forward over the same
     sequence recomputes it; the label is p_acc_i = min(1, p_i(Y_i) / q_i(Y_i))  (:func:`label_responses`).

p and q are the distributions actually sampled from: :func:`specdecpp.core.sampling.warp` of the
logits over the vocabulary both models score, exactly as the engine computes them.
``draft_entropy_i`` is SVIP's entropy of the same draft position: natural log, full (shared)
vocabulary, softmax of logits / temperature (raw softmax under greedy), so that the column
equals what the SVIP policy thresholds at inference. The entropy of the warped q would be 0 under
greedy decoding and truncated under top-k, so it could not explain SVIP's decisions.

Batches are left-padded with an attention mask and explicit position ids. Every prompt has its
own ``torch.Generator`` (see :func:`prompt_generator`) and draws from it in the same order
whether it runs alone or in a batch, so results do not depend on batch composition or sharding
(up to floating-point rounding of the padded matmuls).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..core.hooks import FinalHidden, keep_last
from ..core.sampling import SamplingConfig, entropy, sample, warp
from ..core.verify import acceptance_ratio
from ..decoders.batch import BatchRunner
from ..decoders.cascade import Cascade
from ..fast.buckets import check_fast
from ..fast.calls import CallRunners
from ..models.loading import token_set
from ..models.reduced_vocab import ScoredIds, output_vocab_size


@dataclass
class TokenLabels:
    """Labels of one response, one entry per response token X_i. A feature draft's q_i depends on
    the candidate's depth d in its round (d - 1 of its inputs are its own outputs, not the target's
    features): ``depth_*`` [N, D] hold the labels at depths 1..D (column 0 = the plain columns,
    depth 1; NaN / -1 where the prompt is too short for that depth); None for a plain draft."""

    draft_ids: torch.Tensor      # [N] long: Y_i ~ q_i
    p_acc: torch.Tensor          # [N] float32: min(1, p_i(Y_i) / q_i(Y_i))
    draft_entropy: torch.Tensor  # [N] float32: SVIP's H(q_i), full vocabulary, nats
    depth_draft_ids: torch.Tensor | None = None      # [N, D] long
    depth_p_acc: torch.Tensor | None = None          # [N, D] float32
    depth_draft_entropy: torch.Tensor | None = None  # [N, D] float32


def prompt_generator(seed: int, prompt_id: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded from (seed, prompt id) only: the same prompt gets the same draws
    in any batch, shard or resumed run."""
    digest = hashlib.sha256(f"{int(seed)}:{prompt_id}".encode()).digest()
    return torch.Generator(device=torch.device(device)).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def shared_vocab(draft, target) -> int:
    """Number of token ids both models score (the engine's convention)."""
    return min(output_vocab_size(draft), output_vocab_size(target))


def left_pad(seqs: Sequence[Sequence[int]], device: torch.device, pad_id: int = 0):
    """Left-pad token lists; return ``(input_ids, attention_mask, position_ids)``, each [B, L]."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("left_pad: every sequence needs at least one token")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, width - len(s):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), positions.to(device)


# Sparse target distributions kept while sampling (for labels without a second target forward)
# when every step's warped p has at most this many non-zero entries (top-k, top-p, greedy).
MAX_KEPT_SUPPORT = 4096


@dataclass
class SparseProbs:
    """The warped target distribution p_i of each response token X_i, on its support only:
    p_i = zeros(vocab).scatter_add(0, indices[i], values[i]) (padding entries hold 0)."""

    indices: torch.Tensor  # [N, width] long
    values: torch.Tensor   # [N, width] float32

    def dense(self, i: int, j: int, vocab: int) -> torch.Tensor:
        """p of response tokens i..j-1 as [j - i, vocab]."""
        return self.values.new_zeros((j - i, vocab)).scatter_add_(1, self.indices[i:j], self.values[i:j])


def _sparse_rows(probs: torch.Tensor | None, tokens: list[int], device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's support of this step's p ([B, w] indices and values; ``probs`` None: greedy, the
    one-hot on ``tokens``), or None if too wide."""
    if probs is None:
        return torch.tensor(tokens, device=device).unsqueeze(-1), torch.ones((len(tokens), 1), device=device)
    width = int((probs > 0).sum(-1).max())
    if width > MAX_KEPT_SUPPORT:
        return None
    values, indices = probs.topk(width, dim=-1)
    return indices, values


@torch.no_grad()
def sample_responses(target, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                     max_new_tokens: int, generators: Sequence[torch.Generator],
                     eos_token_id: int | Iterable[int] | None = None, vocab: int | None = None,
                     on_tokens: Callable[[int], None] | None = None,
                     batch_size: int | None = None, fast: str | None = None) -> list[list[int]]:
    """Sample one response per prompt from ``warp(target logits)``, ``batch_size`` rows at a time
    (None: all prompts in one batch), continuously batched: prompts wait in a queue in the given
    order; a row stops after an EOS token (kept in the response) or ``max_new_tokens`` tokens and
    leaves the batch and its KV cache, and the next prompts take the free places (their prompt
    is prefilled, then joined to the batch cache): the batched decoder's own KV bookkeeping,
    :class:`specdecpp.decoders.batch.BatchRunner`, or with ``fast`` ("static" or "compile") the
    fast path's :class:`specdecpp.fast.StaticBatchRunner` (one-token forwards padded to a
    batch bucket; "compile" compiles each bucket once per process). ``on_tokens(n)`` is called
    after each step with the number of tokens just sampled (for progress bars).
    """
    return _sample(target, prompts, sampling, max_new_tokens, generators, eos_token_id, vocab, on_tokens,
                   batch_size, keep_probs=False, fast=fast)[0]


@torch.no_grad()
def sample_responses_with_probs(target, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                                max_new_tokens: int, generators: Sequence[torch.Generator],
                                eos_token_id: int | Iterable[int] | None = None, vocab: int | None = None,
                                on_tokens: Callable[[int], None] | None = None, batch_size: int | None = None,
                                fast: str | None = None) -> tuple[list[list[int]], list[SparseProbs] | None]:
    """:func:`sample_responses`, and each response's p_i as :class:`SparseProbs` (None when a
    step's support is wider than ``MAX_KEPT_SUPPORT``): the target distributions that
    :func:`label_responses` would otherwise recompute with a second target forward."""
    return _sample(target, prompts, sampling, max_new_tokens, generators, eos_token_id, vocab, on_tokens,
                   batch_size, keep_probs=True, fast=fast)


def _sample(target, prompts, sampling, max_new_tokens, generators, eos_token_id, vocab, on_tokens, batch_size,
            keep_probs: bool, fast: str | None):
    """The one decoding loop of :func:`sample_responses` (and its kept p_i)."""
    if len(generators) != len(prompts):
        raise ValueError(f"sample_responses: {len(prompts)} prompts but {len(generators)} generators")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    device = target.device
    vocab = vocab or output_vocab_size(target)
    eos = token_set(eos_token_id)
    slots = batch_size or max(1, len(prompts))
    responses: list[list[int]] = [[] for _ in prompts]
    kept: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = [[] for _ in prompts] if keep_probs else None
    queue = list(range(len(prompts)))[::-1]  # pop() takes the next prompt
    rows: list[int] = []  # batch position -> prompt index
    pending: list[int] = []  # each row's newest token, not yet in the cache (fed by the next step)
    longest = max((len(p) for p in prompts), default=1)  # the batched decoder's KV bookkeeping, or the fast path's
    runner = CallRunners(check_fast("sample_responses", fast, device, target), (target,)).batch(
        longest + max_new_tokens + 1, (1,), slots, eager=BatchRunner)(target, vocab, False)
    while queue or rows:
        if queue and len(rows) < slots:  # the next prompts take the free places: prefix prefilled, joined
            new = [queue.pop() for _ in range(min(slots - len(rows), len(queue)))]
            if any(len(prompts[i]) == 0 for i in new):
                raise ValueError("sample_responses: every prompt needs at least one token")
            runner.add_rows([torch.as_tensor(list(prompts[i][:-1]), dtype=torch.long, device=device) for i in new])
            rows += new
            pending += [int(prompts[i][-1]) for i in new]
        logits = runner.feed(list(torch.tensor(pending, device=device).unsqueeze(1)))[0][:, -1]  # one token per row
        probs = None
        if sampling.greedy:  # the argmax (the one-hot warp would sample it with certainty)
            tokens = logits.argmax(-1).tolist()
        else:
            probs = warp(logits, sampling)
            tokens = torch.stack([sample(probs[b], generators[i]) for b, i in enumerate(rows)]).tolist()
        if kept is not None:
            support = _sparse_rows(probs, tokens, device)
            if support is None:
                kept = None
            else:
                for b, i in enumerate(rows):
                    kept[i].append((support[0][b], support[1][b].float()))
        keep = []
        for b, (i, token) in enumerate(zip(rows, tokens, strict=True)):
            responses[i].append(token)
            if token not in eos and len(responses[i]) < max_new_tokens:
                keep.append(b)
        if on_tokens is not None:
            on_tokens(len(rows))
        if len(keep) < len(rows):  # finished rows leave the batch and the cache
            runner.select(keep)
            rows = [rows[b] for b in keep]
        pending = [tokens[b] for b in keep]
    return responses, None if kept is None else [_stack_support(steps) for steps in kept]


def _stack_support(steps: list[tuple[torch.Tensor, torch.Tensor]]) -> SparseProbs:
    width = max(indices.numel() for indices, _ in steps)
    indices = torch.stack([torch.nn.functional.pad(i, (0, width - i.numel())) for i, _ in steps])
    values = torch.stack([torch.nn.functional.pad(v, (0, width - v.numel())) for _, v in steps])
    return SparseProbs(indices, values)


# Logit elements warped (in float32) at a time when labelling: a chunk of a response's positions
# instead of [batch, length, vocab] logits of both models, so memory stays bounded for long
# responses and large vocabularies (2**22 elements: 16 MiB; 32 positions of a 128k vocabulary).
LABEL_CHUNK_ELEMENTS = 1 << 22


def response_logits(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                    vocab: int) -> Callable[[int, int, int], torch.Tensor]:
    """One batched forward over prompt + response; returns ``logits(b, i, j)``: row b's logits
    [j - i, vocab] that predict response tokens i+1..j (position i sees the prompt and X_<=i).

    The forward keeps only the final hidden states; logits are projected chunk by chunk with the
    model's output layer. A model that post-processes its logits (soft-capping, scaling: the
    projection of the last position does not reproduce the model's own logits there) gets its
    whole logits computed instead."""
    if any(len(r) == 0 for r in responses):
        raise ValueError("response_logits: every response needs at least one token")
    seqs = [list(p) + list(r[:-1]) for p, r in zip(prompts, responses, strict=True)]
    ids, mask, positions = left_pad(seqs, model.device)
    n_max = max(len(r) for r in responses)
    offsets = [n_max - len(r) for r in responses]
    with FinalHidden(model) as final:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                    logits_to_keep=keep_last(ids.shape[1], 1, ids.device), **final.kwargs)
        hidden = final.take(out)[:, -n_max:]
    project = model.get_output_embeddings()
    own = out.logits[:, -1, :vocab].float()
    if project is not None and torch.allclose(project(hidden[:, -1])[:, :vocab].float(), own, rtol=1e-3, atol=1e-3):
        return lambda b, i, j: project(hidden[b, offsets[b] + i: offsets[b] + j])[:, :vocab]
    full = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                 logits_to_keep=keep_last(ids.shape[1], n_max, ids.device)).logits[..., :vocab]
    return lambda b, i, j: full[b, offsets[b] + i: offsets[b] + j]


def feature_draft_logits(draft, target, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         vocab: int, depths: int) -> Callable[[int, int, int, int], torch.Tensor]:
    """A feature draft's logits at every response token and depth
    (:class:`~specdecpp.models.feature_runner.FeaturePass`): ``logits(b, d, i, j)`` is row b's
    logits [j - i, vocab] at depth ``d`` (1-based) for response tokens i..j-1, NaN rows where the
    prompt is too short for that depth."""
    from ..models.feature_runner import FeaturePass

    unrolled = FeaturePass(draft, target, prompts, responses, depths)
    return lambda b, d, i, j: unrolled.logits(b, d, i, j, vocab)


@torch.no_grad()
def label_responses(draft, target, prompts: Sequence[Sequence[int]],
                    responses: Sequence[Sequence[int]], sampling: SamplingConfig,
                    generators: Sequence[torch.Generator], vocab: int | None = None,
                    target_probs: Sequence[SparseProbs] | None = None,
                    cascade: Cascade | None = None, depths: int = 4) -> list[TokenLabels]:
    """Draw Y_i ~ q_i and label it with min(1, p_i(Y_i) / q_i(Y_i)) for every response token.

    A feature draft (:class:`~specdecpp.models.feature_draft.FeatureDraft`) is labelled at every
    depth 1..``depths`` (:class:`TokenLabels`, :func:`feature_draft_logits`): the plain columns are
    depth 1's, and each later depth's Y are drawn after depth 1's, in order of depth.

    ``cascade``: label with the cascade's acceptance min(1, pi_i(Y_i) / q_i(Y_i)) instead, pi_i =
    ``cascade.target(q_i, p_i)`` (specdecpp/decoders/cascade.py); sampled decoding only (temperature > 0).

    One draft forward and one target forward for the whole batch; no target forward when
    ``target_probs`` (kept while sampling, :func:`sample_responses_with_probs`) gives every p_i.
    ``generators[b]`` draws row b's Y (continue the generator used for its response, or a fresh one).
    """
    if not (len(prompts) == len(responses) == len(generators)):
        raise ValueError(f"label_responses: {len(prompts)} prompts, {len(responses)} responses and "
                         f"{len(generators)} generators must match")
    if cascade is not None and sampling.greedy:
        raise ValueError("labels under a cascade need sampled decoding (temperature > 0): the greedy limit "
                         "of a cascade has no acceptance probability to learn")
    from ..models.feature_draft import FeatureDraft

    vocab = vocab or shared_vocab(draft, target)
    feature = isinstance(draft, FeatureDraft)
    if feature:
        if cascade is not None:
            raise ValueError("labels under a cascade take a plain draft: a feature draft's cascade is not supported")
        if depths < 1:
            raise ValueError(f"label_responses: depths must be at least 1 for a feature draft, got {depths}")
        at_depth = feature_draft_logits(draft, target, prompts, responses, vocab, depths)

        def draft_logits(b: int, i: int, j: int) -> torch.Tensor:
            return at_depth(b, 1, i, j)
    else:
        draft_logits = response_logits(draft, prompts, responses, vocab)
    support = ScoredIds(draft)  # a reduced output vocabulary: the entropy over its logits alone
    if target_probs is None:
        target_logits = response_logits(target, prompts, responses, vocab)

        def target_p(b: int, i: int, j: int) -> torch.Tensor:
            return warp(target_logits(b, i, j), sampling)
    else:
        def target_p(b: int, i: int, j: int) -> torch.Tensor:
            return target_probs[b].dense(i, j, vocab)
    chunk = max(1, LABEL_CHUNK_ELEMENTS // vocab)
    labels = []
    for b, (response, gen) in enumerate(zip(responses, generators, strict=True)):
        ys, ratios, entropies = [], [], []
        for i in range(0, len(response), chunk):  # Y drawn in order: the same draws as in one piece
            j = min(i + chunk, len(response))
            d_logits = draft_logits(b, i, j)
            q = warp(d_logits, sampling)
            y = sample(q, gen)
            p = target_p(b, i, j)
            ys.append(y)
            ratios.append(acceptance_ratio(p if cascade is None else cascade.target(q, p), q, y).float())
            entropies.append(entropy(d_logits, sampling.temperature, support(d_logits)).float())
        lab = TokenLabels(draft_ids=torch.cat(ys), p_acc=torch.cat(ratios), draft_entropy=torch.cat(entropies))
        if feature:
            deep = [_label_chunks(functools.partial(at_depth, b, d), functools.partial(target_p, b), len(response),
                                  chunk, sampling, gen, support) for d in range(2, depths + 1)]
            lab.depth_draft_ids = torch.stack([lab.draft_ids] + [y for y, _, _ in deep], dim=1)
            lab.depth_p_acc = torch.stack([lab.p_acc] + [r for _, r, _ in deep], dim=1)
            lab.depth_draft_entropy = torch.stack([lab.draft_entropy] + [e for _, _, e in deep], dim=1)
        labels.append(lab)
    return labels


def _label_chunks(logits_of, target_p, n: int, chunk: int, sampling: SamplingConfig, gen: torch.Generator,
                  support) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One depth's (Y, p_acc, entropy) of a feature draft's response of ``n`` tokens, drawn in
    order; a position without an anchor at this depth (NaN logits) gets Y = -1 and NaN labels,
    and draws nothing."""
    ys, ratios, entropies = [], [], []
    for i in range(0, n, chunk):
        j = min(i + chunk, n)
        d_logits = logits_of(i, j)
        ok = ~d_logits.isnan().any(-1)
        y = torch.full((j - i,), -1, dtype=torch.long, device=d_logits.device)
        ratio = torch.full((j - i,), float("nan"), device=d_logits.device)
        ent = torch.full((j - i,), float("nan"), device=d_logits.device)
        if ok.any():
            q = warp(d_logits[ok], sampling)
            y[ok] = sample(q, gen)
            ratio[ok] = acceptance_ratio(target_p(i, j)[ok.to(q.device)], q, y[ok]).float()
            ent[ok] = entropy(d_logits[ok], sampling.temperature, support(d_logits)).float()
        ys.append(y)
        ratios.append(ratio)
        entropies.append(ent)
    return torch.cat(ys), torch.cat(ratios), torch.cat(entropies)
