"""The runners of a feature-draft pair (docs/feature_draft.md, "In the round core"): the target's runner
keeps the fused features of every position it has read and kept (:class:`FeatureStore`), at no extra
forward, and the draft's runner reads them.

A :class:`~specdecpp.models.feature_draft.FeatureDraft` entry j reads the target's feature g_j and the
token x_{j+1} and predicts x_{j+2}. The draft runner keeps the decoders' runner contract (``feed`` the
tokens after ``length``, ``rollback``, ``compact``) with ``length`` counted in tokens read, x_0 having no
entry: an entry whose feature the target has kept reads it; a drafted position, whose feature no target
forward has computed yet, reads the draft's own output at the entry before (EAGLE's autoregressive
drafting). A rollback keeps only the entries made from the target's features, so after a verification
the kept tokens are fed again over the target's features of those positions, as EAGLE and vLLM do.
Where the target has not read the tokens a round drafts after (a call's first round), the draft cannot
propose: :meth:`FeatureDraftRunner.ready` says so and the round drafts nothing (the target's prefill
gives the first token, as in EAGLE).
"""

from __future__ import annotations

import torch

from .feature_draft import FeatureDraft
from .runner import ModelRunner


class FeatureStore:
    """The target's fused features [positions, F*H] of the cache positions it holds: rows
    ``[:length]`` are valid; a rollback or a compaction follows the target's cache."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.length = 0

    def write(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        if start > self.length:
            raise RuntimeError(f"FeatureStore.write at {start} leaves a gap after {self.length} rows")
        if self.rows is None or end > self.rows.shape[0]:
            grown = rows.new_zeros((max(end, 2 * (0 if self.rows is None else self.rows.shape[0]), 64),
                                    rows.shape[1]))
            if self.rows is not None:
                grown[: self.length] = self.rows[: self.length]
            self.rows = grown
        self.rows[start:end] = rows
        self.length = end

    def read(self, start: int, end: int) -> torch.Tensor:
        if end > self.length:
            raise RuntimeError(f"FeatureStore.read({start}, {end}): the target has kept {self.length} positions")
        return self.rows[start:end]

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)

    def compact(self, keep: list[int]) -> None:
        if keep:
            src = torch.tensor(keep, device=self.rows.device)
            self.rows[: len(keep)] = self.rows.index_select(0, src)
        self.length = len(keep)


class AuxHidden:
    """Captures the inputs of the decoder layers ``layers`` (HF ``hidden_states[i]``) of each forward
    through forward pre-hooks, so the target runs without ``output_hidden_states``."""

    def __init__(self, model, layers: list[int]) -> None:
        decoder = model.get_decoder()
        blocks = getattr(decoder, "layers", None)
        if blocks is None:
            raise ValueError(f"a feature draft reads the target's decoder layers; {type(model).__name__}'s decoder "
                             "has no .layers")
        self.blocks = [blocks[i] for i in layers]
        self.values: list[torch.Tensor | None] = [None] * len(layers)
        self._handles: list = []

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            self.values[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def fused(self) -> torch.Tensor:
        return torch.cat(self.values, dim=-1)

    def __enter__(self) -> AuxHidden:
        self._handles = [b.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, b in enumerate(self.blocks)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self.values = [], [None] * len(self.values)


class FollowsFeatureStore:
    """A feature pair's target runner's ``rollback`` and ``compact``: its ``store`` follows its cache
    (mixed in before the runner class it extends)."""

    store: FeatureStore

    def rollback(self, length: int) -> None:
        super().rollback(length)
        self.store.rollback(length)

    def compact(self, keep) -> None:
        self.store.compact([int(k) for k in keep])
        super().compact(keep)


class RowStores:
    """One :class:`FeatureStore` per row of a batch, in the batch's row order: the target's batch
    runner writes, grows and selects them; the draft's batch runner reads them."""

    def __init__(self) -> None:
        self.rows: list[FeatureStore] = []


class KeepsRowFeatures:
    """A feature pair's target batch runner, eager or static (mixed in before the runner class it
    extends): after each forward, row b's fused features of the tokens it fed go to its store in
    ``stores`` (:class:`RowStores`), which follows the row's rollback, its leaving and its joining.
    :meth:`_fused_of` gives the last forward's fused features [B, W, F*H] (a prefill's: row i is
    prefix i's), however the class that mixes it in computes them."""

    stores: RowStores

    def _fused_of(self) -> torch.Tensor:
        raise NotImplementedError

    def feed(self, chunks: list[torch.Tensor], n_logits: int | None = None):
        starts = list(self.lengths)
        out = super().feed(chunks, n_logits)
        fused = self._fused_of()
        for b, c in enumerate(chunks):  # row b's real tokens are its first len(c) columns
            if c.shape[0]:
                self.stores.rows[b].write(starts[b], fused[b, : c.shape[0]])
        return out

    def rollback(self, lengths: list[int]) -> None:
        super().rollback(lengths)
        for store, n in zip(self.stores.rows, self.lengths, strict=True):
            store.rollback(n)

    def select(self, keep: list[int]) -> None:
        super().select(keep)
        self.stores.rows = [self.stores.rows[b] for b in keep]

    def add_rows(self, prefixes: list[torch.Tensor]) -> None:
        """The new rows' stores hold their prefixes' features (the prefill's, row i prefix i's)."""
        new = [FeatureStore() for _ in prefixes]
        super().add_rows(prefixes)
        if max(int(p.shape[0]) for p in prefixes) > 0:
            fused = self._fused_of()
            for i, (store, p) in enumerate(zip(new, prefixes, strict=True)):
                if p.shape[0]:
                    store.write(0, fused[i, : p.shape[0]])
        self.stores.rows += new


class FeatureTargetRunner(FollowsFeatureStore, ModelRunner):
    """The target's :class:`ModelRunner` that also writes the fused features of every position it
    feeds into ``store`` (the verification's forward computes them anyway)."""

    def __init__(self, model, vocab: int, want_hidden: bool, layers: list[int], store: FeatureStore) -> None:
        super().__init__(model, vocab, want_hidden)
        self.aux, self.store = AuxHidden(model, layers), store

    def __enter__(self):
        self.aux.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.aux.__exit__(*exc)

    def feed(self, ids: torch.Tensor, n_logits: int = 1, position_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None):
        start = self.length
        if not self.aux._handles:  # a runner used outside a ``with``: the hooks for this forward only
            with self.aux:
                return self.feed(ids, n_logits, position_ids, attention_mask)
        out = super().feed(ids, n_logits, position_ids, attention_mask)
        self.store.write(start, self.aux.fused()[0, : ids.shape[0]])
        return out


class FeatureDraftRunner:
    """The feature draft's runner (module docstring): ``feed(ids)`` reads the tokens after ``length``;
    logits [n_logits, vocab] (exactly -inf off the draft's vocabulary) and, with ``want_hidden``, the
    draft's output state [n_logits, H] (what a stop head reads)."""

    def __init__(self, model: FeatureDraft, vocab: int, want_hidden: bool, store: FeatureStore) -> None:
        self.model, self.vocab, self.want_hidden, self.store = model, vocab, want_hidden, store
        self.cache = model.new_cache()
        self.read = 0  # tokens read; x_0 has no entry, so entries = read - 1
        self.from_target = 0  # leading entries made from the target's features
        self.last: tuple[int, torch.Tensor] | None = None  # (entry, its output state)
        self.tree: list[torch.Tensor] = []  # a token tree's fed nodes' output states [1, H], by slot

    def __enter__(self) -> FeatureDraftRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.last = None

    @property
    def length(self) -> int:
        return self.read

    def ready(self, start: int) -> bool:
        """Whether the draft can propose the token after ``seq[:start]``: the target has kept the
        features of every entry before it."""
        return self.store.length >= start - 1 >= max(self.from_target, 1)  # x_0 alone: no entry to read

    def feed(self, ids: torch.Tensor, n_logits: int = 1, position_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None):
        if attention_mask is not None:
            return self._feed_tree(ids, n_logits, position_ids, attention_mask)
        if position_ids is not None:
            raise ValueError("a feature draft's runner feeds a chain (positions follow its cache) or a token tree's "
                             "level (positions with a tree mask)")
        if self.tree:
            raise RuntimeError("feature draft: a chain feed after a token tree's levels, before compact()")
        if self.read == 0:
            ids, self.read = ids[1:], 1  # x_0: no entry reads it
        j, n = self.read - 1, ids.shape[0]
        logits, hidden = [], []
        n_target = max(0, min(n, self.store.length - j))
        if n_target:
            if j != self.from_target:
                raise RuntimeError(f"feature draft: entry {j} reads a target feature after drafted entries "
                                   f"(from {self.from_target})")
            out = self.model(ids[None, :n_target], features=self.store.read(j, j + n_target)[None],
                             cache=self.cache, n_logits=min(n_logits, n_target))
            logits.append(out.logits[0])
            hidden.append(out.hidden[0, -min(n_logits, n_target):])
            self.from_target = j + n_target
            self.last = (j + n_target - 1, out.hidden[:, -1:])
        for i in range(n_target, n):  # drafted positions: one at a time, each on the entry before
            if self.last is None or self.last[0] != j + i - 1:
                raise RuntimeError(f"feature draft: entry {j + i} needs the draft's output at entry {j + i - 1}")
            out = self.model(ids[None, i : i + 1], hidden=self.last[1], cache=self.cache)
            logits.append(out.logits[0])
            hidden.append(out.hidden[0])
            self.last = (j + i, out.hidden)
        self.read += n
        logits = torch.cat(logits)[-n_logits:, : self.vocab]
        return logits, (torch.cat(hidden)[-n_logits:] if self.want_hidden else None)

    def _feed_tree(self, ids: torch.Tensor, n_logits: int, position_ids: torch.Tensor,
                   attention_mask: torch.Tensor):
        """One level of a token tree (specdecpp.decoders.sequoia.TreeDrafter): ``ids`` [m] are fed
        nodes, ``attention_mask`` [m, n + slots] their rows over the committed tokens x_0..x_{n-1}
        (read, all of them) and the tree's fed slots (its ancestors and itself), ``position_ids``
        [m] their token positions. Each node reads its parent's output state (a node of depth 1: the
        root's, the last entry read), as a chain's drafted position reads the entry before; its
        entry goes after the committed ones, at position (token position - 1), x_0 having none."""
        m, before = ids.shape[0], len(self.tree)
        n = attention_mask.shape[1] - before - m
        if n != self.read or self.last is None or self.last[0] != n - 2:
            raise RuntimeError(f"feature draft: a tree level after {n} committed tokens, but the runner has read "
                               f"{self.read} (its last state at entry {None if self.last is None else self.last[0]})")
        states = []
        for j in range(m):
            ancestors = attention_mask[j, n: n + before].nonzero()
            states.append(self.tree[int(ancestors[-1])] if len(ancestors) else self.last[1][0, -1])
        mask = torch.cat([attention_mask[:, 1:n], attention_mask[:, n:]], dim=1)  # x_0 has no entry
        out = self.model(ids[None], hidden=torch.stack(states)[None], position_ids=(position_ids - 1)[None],
                         cache=self.cache, attention_mask=mask[None], n_logits=n_logits)
        self.tree += list(out.hidden[0])
        return out.logits[0, :, : self.vocab], (out.hidden[0, -n_logits:] if self.want_hidden else None)

    def compact(self, keep) -> None:
        """After a token tree's verification: its entries go (the accepted path is fed again over the
        target's features of those positions, as a chain's kept tokens are)."""
        self.tree = []
        self.cache.rollback(self.from_target)

    def rollback(self, length: int) -> None:
        """Keep at most ``length`` tokens read, and of the entries only those made from the target's
        features (the kept tokens are fed again over the target's)."""
        self.read = min(self.read, length, self.from_target + 1)
        self.from_target = max(self.read - 1, 0)
        self.cache.rollback(self.from_target)
        if self.last is not None and self.last[0] >= self.from_target:
            self.last = None

    def kept_cache(self):
        return self.cache


class FeaturePass:
    """A feature draft over whole responses at every depth of a round, for labels and heads: one
    target forward over prompt + response (its decoder only: the fused features of the draft's aux
    layers, no logits) and the draft unrolled ``depths`` steps
    (:meth:`~specdecpp.models.feature_draft.FeatureDraft.unrolled`), rows right-padded. Response
    token X_i (absolute position s = P + i) drafted as a round's d-th candidate reads the target's
    features up to position s - 1 - d and its own outputs after: :meth:`logits` and :meth:`hidden`
    give what drafting it there computes (the state is what a lag-free head reads), NaN rows where
    s - 1 - d < 0 (a prompt shorter than d + 1 tokens). ``candidates`` (optional, one [N_b, depths]
    table per row: the token a round drew as its d-th candidate where X_i stands, data_gen's
    ``depth_draft_ids``): :meth:`after` then gives the state after feeding that candidate (what the
    paper's head reads for it)."""

    @torch.no_grad()
    def __init__(self, draft: FeatureDraft, target, prompts, responses, depths: int, candidates=None) -> None:
        short = [j for j, p in enumerate(prompts) if len(p) < 2]
        if short:
            raise ValueError(f"a feature draft over responses needs prompts of at least 2 tokens (its first candidate "
                             f"reads the target's feature of the token before the prompt's last); prompt {short[0]} "
                             f"has {len(prompts[short[0]])}")
        if depths < 1:
            raise ValueError(f"a feature draft's depths must be at least 1, got {depths}")
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
        width = max(len(q) for q in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, q in enumerate(seqs):
            ids[b, : len(q)] = torch.as_tensor(q, dtype=torch.long)
        ids = ids.to(target.device)
        with AuxHidden(target, draft.aux_layers) as aux:
            target.get_decoder()(input_ids=ids, use_cache=False)
            features = aux.fused()
        self.draft, self.prompt_lengths, self.depths = draft, [len(p) for p in prompts], depths
        probes = None
        if candidates is not None:
            probes = torch.zeros((len(seqs), width - 1, depths), dtype=torch.long)
            for b, (p, r, table) in enumerate(zip(prompts, responses, candidates, strict=True)):
                table = torch.as_tensor(table, dtype=torch.long).reshape(len(r), -1)
                for d in range(1, min(depths, table.shape[1]) + 1):  # token i at depth d: anchor P + i - 1 - d
                    anchors = len(p) - 1 - d + torch.arange(table.shape[0])
                    ok = (anchors >= 0) & (table[:, d - 1] >= 0)
                    probes[b, anchors[ok], d - 1] = table[ok, d - 1]
        self.steps = draft.unrolled(ids.to(draft.device), features.to(draft.device), depths,
                                    None if probes is None else probes.to(draft.device))

    def _rows(self, x: torch.Tensor, b: int, d: int, i: int, j: int) -> tuple[torch.Tensor, int]:
        start = self.prompt_lengths[b] + i - 1 - d  # the anchor of response token i at depth d
        lo = max(start, 0)
        return x[b, lo: start + (j - i)], lo - start

    @staticmethod
    def _pad(out: torch.Tensor, missing: int) -> torch.Tensor:
        if not missing:
            return out
        return torch.cat([out.new_full((missing, *out.shape[1:]), float("nan")), out])

    def hidden(self, b: int, d: int, i: int, j: int) -> torch.Tensor:
        """[j - i, H]: the draft's state that produced q of response tokens i..j-1 at depth d."""
        rows, missing = self._rows(self.steps[d - 1].hidden, b, d, i, j)
        return self._pad(rows.float(), missing)

    def after(self, b: int, d: int, i: int, j: int) -> torch.Tensor:
        """[j - i, H]: the draft's state after feeding the d-th candidate drawn where response tokens
        i..j-1 stand (``candidates``), what the paper's head reads for it."""
        if self.steps[d - 1].after is None:
            raise ValueError("FeaturePass.after needs the candidates (FeaturePass(..., candidates=...))")
        rows, missing = self._rows(self.steps[d - 1].after, b, d, i, j)
        return self._pad(rows.float(), missing)

    @torch.no_grad()
    def logits(self, b: int, d: int, i: int, j: int, vocab: int) -> torch.Tensor:
        """[j - i, vocab] float32: the draft's logits for response tokens i..j-1 at depth d."""
        rows, missing = self._rows(self.steps[d - 1].normed, b, d, i, j)
        return self._pad(self.draft.full_logits(self.draft.lm_head(rows))[:, :vocab].float(), missing)


def feature_pair(draft, target) -> bool:
    """Whether ``draft`` is a feature draft (it needs :func:`feature_runners`)."""
    return isinstance(draft, FeatureDraft)


def feature_runners(draft: FeatureDraft, target, target_runner=FeatureTargetRunner):
    """The runner factories ``(draft_runners, target_runners)`` of a feature pair, each called as
    ``(model, vocab, want_hidden)``, sharing one :class:`FeatureStore`. ``target_runner``: the
    target's runner class, called as ``(model, vocab, want_hidden, layers, store)``: the eager
    :class:`FeatureTargetRunner`, or the fast path's (specdecpp.fast.features)."""
    draft.check_target(target)
    store = FeatureStore()
    return (lambda model, vocab, want_hidden: FeatureDraftRunner(model, vocab, want_hidden, store),
            lambda model, vocab, want_hidden: target_runner(model, vocab, want_hidden, draft.aux_layers, store))


def refuse_feature_draft(draft, who: str, why: str) -> None:
    """A decoder that cannot feed a feature draft says so, naming it."""
    if isinstance(draft, FeatureDraft):
        raise ValueError(f"{who} does not take a feature draft (FeatureDraft {draft.name_or_path or 'built'!r}, "
                         f"aux layers {draft.aux_layers}): {why}. Use SpeculativeDecoder with a stop policy, or a "
                         "plain draft model")
