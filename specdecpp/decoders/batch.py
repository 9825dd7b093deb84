"""The batch-specific parts of the round core: a KV cache over rows of different lengths and a
drafter that drafts every still-drafting row in one forward, each row stopping on its own.

``SpeculativeDecoder.generate_batch`` is the chain's loop over these parts and the shared ones of
:mod:`specdecpp.decoders.rounds` (one :class:`~specdecpp.decoders.rounds.TokenBuffer`, one
:class:`~specdecpp.decoders.rounds.RunStats` and one generator per row; :class:`~specdecpp.decoders.rounds.ExactRule`
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

from dataclasses import dataclass

import torch

from ..core.compat import cache_kwargs
from ..core.hooks import FinalHidden, keep_last, new_cache
from ..core.sampling import SamplingConfig, sample, warp
from ..core.timing import Clock
from ..models.runner import HiddenHook
from ..stopping.policies import StopPolicy
from .rounds import check_generate_args

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
    if mask.shape[1] == 0 or not bool(mask.any()):
        return mask[:, mask.shape[1]:]
    first = int(mask.any(0).int().argmax())
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
    :meth:`BatchDrafter.peek` ran for this block (one forward for all rows)."""

    ks: list[int]
    q: list[torch.Tensor]
    t0: float
    t1: float
    logits: list[torch.Tensor] | None = None
    peeked: torch.Tensor | None = None

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
                 clock: Clock, fill: bool = False, keep_logits: bool = False) -> None:
        self.policy, self.sampling, self.clock, self.fill = policy, sampling, clock, fill
        self.keep_logits = keep_logits
        self.needs_hidden = policy.needs_hidden
        self.runner = BatchRunner(model, vocab, want_hidden=self.needs_hidden)
        self.eos = torch.tensor(sorted(eos), dtype=torch.long, device=self.runner.device)

    def __enter__(self) -> BatchDrafter:
        self.runner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.runner.__exit__(*exc)

    def block(self, seqs: list, counts: list[int], gens: list) -> BatchBlock:
        """Draft at most ``counts[b]`` candidates into ``seqs[b].tokens[seqs[b].n:]``."""
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
            if cfg.greedy:  # the argmax; verification needs no q
                y = logits.argmax(-1)
            else:
                q = warp(logits, cfg)
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

    def peek(self, block: BatchBlock, seqs: list, b: int) -> torch.Tensor:
        """Row b's raw draft logits after its last candidate (a cascade's bonus token needs the
        draft's q there). The first call of a block feeds every row its pending tokens in one
        forward (the tokens the next round would feed anyway) and keeps all rows' logits."""
        if block.peeked is None:
            runner = self.runner
            chunks = [s.tokens[runner.lengths[r] : s.n + block.ks[r]] for r, s in enumerate(seqs)]
            logits = runner.feed(chunks)[0]
            last = torch.tensor([c.shape[0] - 1 for c in chunks], device=runner.device)
            block.peeked = logits[torch.arange(len(seqs), device=runner.device), last]
        return block.peeked[b]


def check_batch_args(prompts, max_new_tokens, generators, batch_size) -> None:
    """The argument checks of ``generate_batch``: each prompt as ``generate`` checks it."""
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of 1-D LongTensors (one prompt per row), got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is an empty list: give at least one prompt")
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.dtype != torch.long:
            raise ValueError(f"prompts[{i}] must be a 1-D LongTensor of token ids, got "
                             f"{getattr(p, 'shape', type(p).__name__)} {getattr(p, 'dtype', '')}".rstrip())
        if p.shape[0] == 0:
            raise ValueError(f"prompts[{i}] is empty: give at least one prompt token (e.g. BOS)")
    check_generate_args(prompts[0].unsqueeze(0), max_new_tokens)
    if generators is not None and (not isinstance(generators, (list, tuple)) or len(generators) != len(prompts)):
        raise ValueError(f"generators must be a list of one torch.Generator per prompt ({len(prompts)}), got "
                         f"{len(generators) if isinstance(generators, (list, tuple)) else type(generators).__name__}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 (None: every prompt at once), got {batch_size!r}")
