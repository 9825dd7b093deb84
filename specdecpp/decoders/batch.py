"""Batch decoding: a KV cache over rows of different lengths (:class:`BatchRunner`), a drafter that
drafts every still-drafting row in one forward, each row stopping on its own (:class:`BatchDrafter`),
and the loop over them (:func:`generate_batch`, behind ``SpeculativeDecoder.generate_batch``): rows
join, draft, verify, commit and retire as named steps of one :class:`BatchRun`, with the shared parts
of :mod:`specdecpp.decoders.rounds` (one :class:`~specdecpp.decoders.rounds.TokenBuffer`, one
:class:`~specdecpp.decoders.rounds.RunStats` and one generator per row; the decoder's acceptance rule
per row; :class:`~specdecpp.core.timing.Clock`).

KV bookkeeping (:class:`BatchRunner`): one transformers cache of shape [B, heads, T, d] and an
attention mask [B, T] that says which columns hold a token of the row. A forward appends the same
number W of columns to every row: row b's ``m_b`` real tokens first, then ``W - m_b`` holes
(masked, never attended to), with explicit position ids ``length_b + j``. Rolling row b back to
``n`` tokens masks its newest columns (``mask *= cumsum(mask) <= n``: one device op for all rows,
no host read), so a rejected candidate becomes a hole instead of being cut. Holes are removed by
:meth:`BatchRunner.compact` (one stable argsort of the mask and one gather per layer, which moves
each row's tokens to the right end) once more than ``COMPACT_AT`` columns are removable; finished
rows leave with a batch select and new rows join left-padded (:func:`join_rows`). data_gen's
target sampling (:func:`specdecpp.data.labels.sample_responses`) runs on this runner too. What it costs: every forward
attends over T >= max_b length_b columns (the longest row's length plus the holes since the last
compaction) and computes W columns for every row, also for rows that wait (a stopped row feeds a
hole while the others draft on).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

import torch

from ..core.compat import cache_kwargs
from ..core.hooks import FinalHidden, keep_last, new_cache
from ..core.sampling import SamplingConfig, argmax, sample, warp
from ..core.timing import Clock
from ..fast.features import StaticBatchFeatureTargetRunner
from ..models.runner import HiddenHook
from ..stopping.policies import StopPolicy
from .rounds import (
    CallHooks,
    Candidates,
    GenerateOutput,
    RunStats,
    TokenBuffer,
    check_generate_args,
    check_hooks,
    check_token_ids,
    device_generator,
    finish,
)

# Removable hole columns (the cache width beyond the longest row) that trigger a compaction.
COMPACT_AT = 32


def left_pad_to(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zeros on the left of ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _filled(layer) -> bool:
    return getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None \
        and layer.keys.numel() > 0


def join_rows(cache, mask: torch.Tensor, other, other_mask: torch.Tensor) -> torch.Tensor:
    """Append ``other``'s rows to ``cache`` (in place), both left-padded to one width; return the
    joined attention mask [B + B', T]. A side that holds no column yet counts as zero columns."""
    width = max(mask.shape[1], other_mask.shape[1])
    for layer, new in zip(cache.layers, other.layers, strict=True):
        if not _filled(layer) and not _filled(new):
            continue
        ref = new if _filled(new) else layer
        parts = []
        for side, rows in ((layer, mask.shape[0]), (new, other_mask.shape[0])):
            if _filled(side):
                parts.append((side.keys, side.values))
            else:
                parts.append((ref.keys.new_zeros((rows, ref.keys.shape[1], 0, ref.keys.shape[3])),
                              ref.values.new_zeros((rows, ref.values.shape[1], 0, ref.values.shape[3]))))
        keys = torch.cat([left_pad_to(k, width, 2) for k, _ in parts])
        values = torch.cat([left_pad_to(v, width, 2) for _, v in parts])
        if getattr(layer, "is_initialized", True):
            layer.keys, layer.values = keys, values
        else:
            layer.update(keys, values)  # initialises the layer as a forward would
    return torch.cat([left_pad_to(mask, width, 1), left_pad_to(other_mask, width, 1)])


def trim_left(cache, mask: torch.Tensor) -> torch.Tensor:
    """Drop the leading cache columns that no row attends to (left by rows that finished)."""
    if mask.shape[1] == 0:
        return mask
    # no row attends to any column: every column goes (the cache's with the mask's)
    first = int(mask.any(0).int().argmax()) if bool(mask.any()) else mask.shape[1]
    if first > 0:
        for layer in cache.layers:
            if _filled(layer):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
    return mask[:, first:]


class BatchRunner(HiddenHook):
    """One model and its KV cache over a batch of rows; ``lengths[b]`` tokens of row b are cached
    (the columns where ``mask[b]`` is 1, in order). Rows join (:meth:`add_rows`), leave
    (:meth:`select`), are fed ragged chunks (:meth:`feed`) and rolled back one length per row
    (:meth:`rollback`). See the module docstring for the layout and its costs."""

    def __init__(self, model, vocab: int, want_hidden: bool) -> None:
        self.model, self.vocab, self.want_hidden = model, vocab, want_hidden
        self.device = model.device
        self.cache = new_cache(model)
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.lengths: list[int] = []
        self.final = FinalHidden(model) if want_hidden else None
        self.n_compactions = 0

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Cache columns T (tokens and holes)."""
        return self.mask.shape[1]

    def feed(self, chunks: list[torch.Tensor], n_logits: int | None = None):
        """Append ``chunks[b]`` (1-D, possibly empty) to row b in one forward of width
        W = max length. Returns logits [B, W', V] and hidden [B, W', H] (or None) of the last W'
        = ``n_logits`` (None: all W) columns; row b's real tokens are its first ``len(chunks[b])``
        columns, the rest are holes whose outputs are filler."""
        if len(chunks) != self.rows:
            raise ValueError(f"BatchRunner.feed: {len(chunks)} chunks for {self.rows} rows")
        m = [int(c.shape[0]) for c in chunks]
        width = max(m)
        ids = torch.zeros((self.rows, width), dtype=torch.long, device=self.device)
        for b, c in enumerate(chunks):
            ids[b, : m[b]] = c
        real = torch.arange(width, device=self.device) < torch.tensor(m, device=self.device).unsqueeze(1)
        start = torch.tensor(self.lengths, device=self.device).unsqueeze(1)
        positions = start + torch.arange(width, device=self.device)
        self.mask = torch.cat([self.mask, real.long()], dim=1)
        kwargs = self.final.kwargs if self.final is not None else {}
        keep = width if n_logits is None else min(n_logits, width)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                         **cache_kwargs(self.model, self.cache), logits_to_keep=keep_last(width, keep, self.device),
                         **kwargs)
        self.lengths = [n + k for n, k in zip(self.lengths, m, strict=True)]
        hidden = self.final.take(out)[:, width - keep:] if self.final is not None else None
        return out.logits[..., : self.vocab], hidden

    def rollback(self, lengths: list[int]) -> None:
        """Keep the first ``lengths[b]`` tokens of row b (no-op for rows with fewer cached): the
        newer ones become holes; compact once enough columns are holes in every row."""
        self.lengths = [min(n, keep) for n, keep in zip(self.lengths, lengths, strict=True)]
        if self.rows:
            keep = torch.tensor(self.lengths, device=self.device).unsqueeze(1)
            self.mask = self.mask * (self.mask.cumsum(1) <= keep)
        if self.rows and self.width - max(self.lengths) >= COMPACT_AT:
            self.compact()

    def compact(self) -> None:
        """Move each row's tokens to the right end and drop the columns no row needs: a stable sort
        of the mask keeps every row's order; the holes sort first and are cut."""
        width = max(self.lengths, default=0)
        order = torch.argsort(self.mask, dim=1, stable=True)[:, self.width - width:]
        for layer in self.cache.layers:
            if _filled(layer):
                index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys = layer.keys.gather(2, index)
                layer.values = layer.values.gather(2, index.expand(-1, -1, -1, layer.values.shape[3]))
        self.mask = self.mask.gather(1, order)
        self.n_compactions += 1

    def select(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (in that order); the others leave the batch and the cache."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = trim_left(self.cache, self.mask[index])
        self.lengths = [self.lengths[b] for b in keep]

    def add_rows(self, prefixes: list[torch.Tensor]) -> None:
        """New rows at the end of the batch, their ``prefixes`` prefilled in one forward of their
        own (the rows already here run nothing) and joined to the cache, left-padded."""
        fresh = BatchRunner(self.model, self.vocab, want_hidden=False)
        fresh.lengths = [0] * len(prefixes)
        fresh.mask = torch.zeros((len(prefixes), 0), dtype=torch.long, device=self.device)
        if max(int(p.shape[0]) for p in prefixes) > 0:
            fresh.feed(prefixes, n_logits=1)
        if self.rows:
            self.mask = join_rows(self.cache, self.mask, fresh.cache, fresh.mask)
        else:
            self.cache, self.mask = fresh.cache, fresh.mask
        self.lengths += fresh.lengths

    def row_cache(self, b: int):
        """Row b's cached tokens alone, as a fresh transformers cache [1, heads, lengths[b], d]."""
        cache, columns = new_cache(self.model), self.mask[b].nonzero().squeeze(1)
        for i, layer in enumerate(self.cache.layers):
            if _filled(layer):
                cache.layers[i].update(layer.keys[b : b + 1, :, columns], layer.values[b : b + 1, :, columns])
        return cache


@dataclass
class BatchBlock:
    """A drafted block per row: row b wrote ``ks[b]`` candidates after its committed tokens and,
    unless greedy, ``q[j][b]`` is the row the j-th was sampled from; with ``keep_logits`` (a
    cascade) ``logits[j][b]`` are the draft's raw logits there. ``t0``/``t1`` bracket it.
    ``peeked``: the draft's raw logits [B, V] after every row's last candidate, once
    :meth:`BatchDrafter.peek` ran for this block (one forward for all rows); ``extra_forwards[b]``:
    1 if row b asked for them (a cascade's bonus token), counted in the row's draft forwards."""

    ks: list[int]
    q: list[torch.Tensor]
    t0: float
    t1: float
    logits: list[torch.Tensor] | None = None
    peeked: torch.Tensor | None = None
    extra_forwards: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.extra_forwards = [0] * len(self.ks)

    def q_rows(self, b: int) -> list[torch.Tensor]:
        return [q[b] for q in self.q[: self.ks[b]]]

    def draft_logits(self, b: int) -> torch.Tensor | None:
        """Row b's raw draft logits of its candidates [ks[b], V] (None without ``keep_logits``)."""
        if self.logits is None or not self.ks[b]:
            return None
        return torch.stack([x[b] for x in self.logits[: self.ks[b]]])


class BatchDrafter:
    """Drafts a block for every row of a batch: each step feeds every still-drafting row its
    newest token in one draft forward, samples each row's candidate with the row's own generator,
    and asks the policy ``stop_rows`` for all rows at once (on the device). A row stops at its
    policy's stop, at its ``count`` or at EOS; it then waits (feeds a hole) until the round ends.
    With ``fill`` a row whose policy stopped keeps drafting while another row's policy still
    drafts (its hole would be computed anyway): the round ends when every row's policy stopped,
    and rows stop on their own only at their ``count`` or EOS.
    The stop decisions are read on the host once per draft step."""

    def __init__(self, model, vocab: int, policy: StopPolicy, sampling: SamplingConfig, eos: set[int],
                 clock: Clock, fill: bool = False, keep_logits: bool = False, runners=None) -> None:
        """``runners``: builds the draft's runner as ``runners(model, vocab, want_hidden)``,
        :class:`BatchRunner` by default (the fast path's: a ``CallRunners.batch`` call)."""
        self.policy, self.sampling, self.clock, self.fill = policy, sampling, clock, fill
        self.keep_logits = keep_logits
        self.needs_hidden = policy.needs_hidden
        self.runner = (runners or BatchRunner)(model, vocab, want_hidden=self.needs_hidden)
        self.eos = torch.tensor(sorted(eos), dtype=torch.long, device=self.runner.device)

    def __enter__(self) -> BatchDrafter:
        self.runner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.runner.__exit__(*exc)

    def block(self, seqs: list, counts: list[int], gens: list, process=None) -> BatchBlock:
        """Draft at most ``counts[b]`` candidates into ``seqs[b].tokens[seqs[b].n:]``; ``process``: a
        :class:`~specdecpp.decoders.rounds.CallHooks` ``draft_logits`` hook for the rows q is drawn
        from (the drafting rows'; the policy reads the raw ones)."""
        t0 = self.clock.now()
        runner, cfg, device = self.runner, self.sampling, self.runner.device
        rows = len(seqs)
        ks, q_steps, kept = [0] * rows, [], [] if self.keep_logits else None
        drafting = [c > 0 for c in counts]  # the host's copy of ``active``
        if not any(drafting):
            return BatchBlock(ks, q_steps, t0, self.clock.now(), kept)
        self.policy.begin_round(torch.tensor([s.n - s.prompt_len for s in seqs], device=device)
                                if self.policy.needs_position else None)  # no copy to the device otherwise
        active = torch.tensor(drafting, device=device)  # the policy still drafts this row
        bounded = active.clone()  # the row is below its count and drew no EOS yet
        limit = torch.tensor(counts, device=device)
        k = 0
        while any(drafting):
            k += 1
            chunks = [s.tokens[runner.lengths[b] : s.n + k - 1] if drafting[b] else s.tokens[:0]
                      for b, s in enumerate(seqs)]
            logits, hidden = runner.feed(chunks)
            last = torch.tensor([max(c.shape[0] - 1, 0) for c in chunks], device=device)
            rows_index = torch.arange(rows, device=device)
            logits = logits[rows_index, last]
            hidden = hidden[rows_index, last] if self.needs_hidden else None
            if kept is not None:
                kept.append(logits)
            scores = logits if process is None else self.processed(process, seqs, drafting, k, logits)
            if cfg.greedy:  # the argmax (the first of ties); no q needed
                y = argmax(scores)
            else:
                q = warp(scores, cfg)
                y = torch.stack([sample(q[b], gens[b]) if drafting[b] else q.new_zeros((), dtype=torch.long)
                                 for b in range(rows)])
                q_steps.append(q)
            for b, s in enumerate(seqs):
                if drafting[b]:
                    s.tokens[s.n + k - 1] = y[b]
                    ks[b] = k
            bounded = bounded & (limit > k) & ~torch.isin(y, self.eos)
            active = active & bounded & ~self.policy.stop_rows(k, logits, hidden, y, active)
            drafting = (bounded & active.any() if self.fill else active).tolist()  # the one host read of this step
        return BatchBlock(ks, q_steps, t0, self.clock.now(), kept)

    @staticmethod
    def processed(process, seqs: list, drafting: list[bool], k: int, logits: torch.Tensor) -> torch.Tensor:
        """The drafting rows' logits [B, V] (each after its row's ``n + k - 1`` tokens) through ``process``."""
        rows = [b for b, d in enumerate(drafting) if d]
        out = logits.to(torch.float32, copy=True)  # the processed rows are float32 (transformers' processors run so)
        out[rows] = process([seqs[b].row for b in rows], [seqs[b].tokens for b in rows],
                            [seqs[b].n + k - 1 for b in rows], logits[rows])
        return out

    def candidates(self, block: BatchBlock, seqs: list, b: int) -> Candidates:
        """Row b's candidates as a rule reads them."""
        s = seqs[b]
        return Candidates(s.tokens[s.n : s.n + block.ks[b]], block.q_rows(b), block.draft_logits(b),
                          partial(self.peek, block, seqs, b))

    def peek(self, block: BatchBlock, seqs: list, b: int) -> torch.Tensor:
        """Row b's raw draft logits after its last candidate (a cascade's bonus token needs the
        draft's q there). The first call of a block feeds every row its pending tokens in one
        forward (the tokens the next round would feed anyway) and keeps all rows' logits."""
        block.extra_forwards[b] = 1
        if block.peeked is None:
            runner = self.runner
            chunks = [s.tokens[runner.lengths[r] : s.n + block.ks[r]] for r, s in enumerate(seqs)]
            logits = runner.feed(chunks)[0]
            last = torch.tensor([c.shape[0] - 1 for c in chunks], device=runner.device)
            block.peeked = logits[torch.arange(len(seqs), device=runner.device), last]
        return block.peeked[b]


def check_batch_args(prompts, max_new_tokens, generators, batch_size, models=None) -> None:
    """The argument checks of ``generate_batch``: each prompt as ``generate`` checks it (its ids
    against ``models``, the decoder's ``(draft, target)``)."""
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of 1-D LongTensors (one prompt per row), "
                         f"got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is an empty list: give at least one prompt")
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.dtype != torch.long:
            raise ValueError(f"prompts[{i}] must be a 1-D LongTensor of token ids, got "
                             f"{getattr(p, 'shape', type(p).__name__)} {getattr(p, 'dtype', '')}".rstrip())
        if p.shape[0] == 0:
            raise ValueError(f"prompts[{i}] is empty: give at least one prompt token (e.g. BOS)")
        if models is not None:
            check_token_ids(p, models, f"prompts[{i}]")
    check_generate_args(prompts[0].unsqueeze(0), max_new_tokens)
    if generators is not None and (not isinstance(generators, (list, tuple)) or len(generators) != len(prompts)):
        raise ValueError(f"generators must be a list of one torch.Generator per prompt ({len(prompts)}), got "
                         f"{len(generators) if isinstance(generators, (list, tuple)) else type(generators).__name__}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 (None: every prompt at once), got {batch_size!r}")


class BatchRun:
    """One ``generate_batch`` call: every prompt's buffer, generator and stats, the two models'
    :class:`BatchRunner` (the draft's inside :class:`BatchDrafter`), the prompts waiting for a slot
    and the rows decoding now (``rows[b]``: the prompt in slot b). Each step of the loop is a method.

    ``decoder``: a :class:`~specdecpp.decoders.chain.SpeculativeDecoder` (its models, vocabulary,
    device, policy, sampling, acceptance rule and ``profile``)."""

    def __init__(self, decoder, prompts: list[torch.Tensor], max_new_tokens: int, generators, eos_token_id,
                 batch_size: int | None, fill: bool, return_caches: bool, hooks: CallHooks | None = None,
                 feature_runners=None) -> None:
        """``feature_runners``: a feature pair's runner factories,
        :func:`~specdecpp.decoders.batch_features.batch_feature_runners` (this module cannot import it)."""
        self.policy, self.rule, self.return_caches = decoder.policy, decoder.rule, return_caches
        self.hooks = hooks or CallHooks()
        self.gens = [device_generator(g, decoder.device) for g in (generators or [None] * len(prompts))]
        self.clock, self.marks = Clock(decoder.device), Clock(decoder.device, sync=decoder.profile)
        self.seqs = [TokenBuffer(p, max_new_tokens, eos_token_id, decoder.device, i, hooks)
                     for i, p in enumerate(prompts)]
        self.slots = batch_size or len(prompts)
        tokens, ((_, draft_buckets), (_, target_buckets)) = decoder.fast_plan(max(s.prompt_len for s in self.seqs),
                                                                              max_new_tokens)
        if feature_runners is not None:  # a feature pair's: the draft's eager, the target's as decoder.fast chooses
            static = None if decoder.fast is None else decoder.runners.batch(
                tokens, target_buckets, rows=self.slots, static=StaticBatchFeatureTargetRunner)
            draft_runners, target_runners = feature_runners(decoder.draft, decoder.target, static)
        else:
            runners = partial(decoder.runners.batch, tokens, rows=self.slots, eager=BatchRunner)  # decoder.fast chooses
            draft_runners, target_runners = runners(draft_buckets), runners(target_buckets)
        self.drafter = BatchDrafter(decoder.draft, decoder.vocab, decoder.policy, decoder.sampling, self.seqs[0].eos,
                                    self.marks, fill, keep_logits=decoder.rule.lossy, runners=draft_runners)
        self.target = target_runners(decoder.target, decoder.vocab, want_hidden=False)
        # the draft runs when the policy drafts, or for a cascade's bonus token (peek) even without candidates
        self.drafting = decoder.drafts
        self.runners = [self.target, self.drafter.runner] if self.drafting else [self.target]
        self.stats, self.joined = [RunStats() for _ in prompts], [0.0] * len(prompts)
        self.outputs: list[GenerateOutput | None] = [None] * len(prompts)
        self.queue, self.rows = list(range(len(prompts)))[::-1], []  # pop() takes the next prompt
        # (rows, longest K, draft forwards) per round: costmodel.batch_latency
        self.rounds: list[tuple[int, int, int]] = []

    @property
    def live(self) -> list[TokenBuffer]:
        return [self.seqs[i] for i in self.rows]

    def join_rows(self) -> None:
        """Waiting prompts take the free slots, their prefixes prefilled in a forward of their own."""
        new = [self.queue.pop() for _ in range(min(self.slots - len(self.rows), len(self.queue)))]
        if new:
            prefixes = [self.seqs[i].tokens[: self.seqs[i].n - 1] for i in new]
            for runner in self.runners:
                runner.add_rows(prefixes)
            self.rows += new
            for i in new:
                self.joined[i] = self.clock.now()

    def draft(self) -> BatchBlock:
        """Every row drafts up to its policy's stop, never past its length limit; a feature draft's row
        once the features it reads exist."""
        live = self.live
        ready = getattr(self.drafter.runner, "can_draft", None) if self.drafting else None  # (no rows: it never ran)
        return self.drafter.block(live, [min(self.policy.max_candidates, s.room - 1)
                                         if ready is None or ready(b, s.n) else 0 for b, s in enumerate(live)],
                                  [self.gens[i] for i in self.rows], self.hooks.draft_logits)

    def verify(self, block: BatchBlock) -> tuple[list[tuple[int, int | None, list | None]], float]:
        """One target forward over every row's candidates (p_1..p_{K_b+1} per row), then each row's
        ``(n_accepted, token, drafts read)`` from the rule with the row's generator (the drafts as the
        rule read them, :attr:`Candidates.read`, for the commit); and when they were known."""
        live, ks = self.live, block.ks
        chunks = [s.tokens[self.target.lengths[b] : s.n + k] for b, (s, k) in enumerate(zip(live, ks, strict=True))]
        logits = self.target.feed(chunks)[0]
        rows = [logits[b, : k + 1] for b, k in enumerate(ks)]
        process = self.hooks.target_logits
        if process is not None:  # every row's positions in one call
            done = process([s.row for s, k in zip(live, ks, strict=True) for _ in range(k + 1)],
                           [s.tokens for s, k in zip(live, ks, strict=True) for _ in range(k + 1)],
                           [s.n + j for s, k in zip(live, ks, strict=True) for j in range(k + 1)], torch.cat(rows))
            rows = list(done.split([k + 1 for k in ks]))
        verdicts = []
        for b, i in enumerate(self.rows):
            candidates = self.drafter.candidates(block, live, b)
            verdicts.append((*self.rule(candidates, rows[b], self.gens[i]), candidates.read))
        return verdicts, self.marks.now()

    def commit(self, block: BatchBlock, verdicts: list[tuple[int, int | None, list | None]], t_verified: float) -> None:
        """Each row commits its verdict (without reading its drafts back where the rule read them) and
        counts its round; both caches roll back to the commits."""
        k_max = max(block.ks)
        self.rounds.append((len(self.rows), k_max, k_max + (block.peeked is not None)))
        for i, k, (n_acc, token, read), extra in zip(self.rows, block.ks, verdicts, block.extra_forwards, strict=True):
            kept = self.seqs[i].commit(n_acc, token, read)
            self.stats[i].add_round(k + extra, k, n_acc, k + 1 - kept, block.t1 - block.t0, t_verified - block.t1)
        for runner in self.runners:
            runner.rollback([s.n - 1 for s in self.live])

    def retire_finished(self) -> None:
        """Rows that finished (EOS, length) leave the batch with their output."""
        done = [b for b, s in enumerate(self.live) if s.finished]
        if done:
            now = self.clock.now()
            for b in done:
                self.outputs[self.rows[b]] = self.output(b, now)
            keep = [b for b in range(len(self.rows)) if b not in done]
            for runner in self.runners:
                runner.select(keep)
            self.rows = [self.rows[b] for b in keep]

    def output(self, b: int, now: float) -> GenerateOutput:
        """Row b's output; its wall time runs from its joining to ``now``."""
        i = self.rows[b]
        out = finish(self.stats[i], self.seqs[i], now - self.joined[i], None, None, False)
        out.batch_size, out.batch_rounds = self.slots, self.rounds
        if self.return_caches:
            out.caches = {"draft": self.drafter.runner.row_cache(b) if self.drafting else None,
                          "target": self.target.row_cache(b)}
        return out

    def results(self) -> list[GenerateOutput]:
        if not self.marks.exact:
            for s in self.stats:
                s.draft_time_s = s.target_time_s = float("nan")
        return self.outputs


def generate_batch(decoder, prompts: list[torch.Tensor], max_new_tokens: int = 128,
                   generators: list[torch.Generator | None] | None = None,
                   eos_token_id: int | Iterable[int] | None = None, batch_size: int | None = None,
                   return_caches: bool = False, fill: bool = False,
                   hooks: CallHooks | None = None, feature_runners=None) -> list[GenerateOutput]:
    """``decoder.generate_batch``'s loop (:meth:`~specdecpp.decoders.chain.SpeculativeDecoder.generate_batch`
    says what it returns)."""
    check_batch_args(prompts, max_new_tokens, generators, batch_size, (decoder.draft, decoder.target))
    check_hooks(hooks)
    if not isinstance(fill, bool):
        raise ValueError(f"fill must be True or False, got {fill!r}")
    if getattr(decoder, "feature", False) and feature_runners is None:
        raise ValueError("generate_batch: a feature pair's batch needs its runners (feature_runners="
                         "specdecpp.decoders.batch_features.batch_feature_runners); call decoder.generate_batch")
    run = BatchRun(decoder, prompts, max_new_tokens, generators, eos_token_id, batch_size, fill, return_caches, hooks,
                   feature_runners)
    with run.drafter:
        while run.queue or run.rows:
            run.join_rows()
            block = run.draft()
            verdicts, t_verified = run.verify(block)
            run.commit(block, verdicts, t_verified)
            run.retire_finished()
    return run.results()
