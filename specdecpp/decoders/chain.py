"""Speculative decoding with any stop policy: each round drafts candidates, verifies them in one
target pass and rolls both KV caches back to the accepted prefix (the parts: specdecpp/decoders/rounds.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..core.attention import decoding
from ..core.sampling import SamplingConfig
from ..fast.buckets import DRAFT_BUCKETS, GRAPH_BACKENDS, check_fast, fit_buckets
from ..fast.calls import CallRunners
from ..fast.features import fast_feature_runners
from ..models.feature_runner import feature_pair, refuse_feature_draft
from ..models.reduced_vocab import output_vocab_size
from ..stopping.policies import StopPolicy
from .batch import generate_batch
from .batch_features import batch_feature_runners
from .cascade import Cascade, CascadeRule
from .replay import CapturedRounds
from .rounds import (
    CallHooks,
    Drafter,
    ExactRule,
    FastPlanned,
    GenerateOutput,
    RunStats,
    check_pair_devices,
    finish,
    processed,
    start_generate,
)


class SpeculativeDecoder(FastPlanned):
    """Speculative decoding of one prompt (batch 1) with any :class:`StopPolicy`.

    Both caches hold every committed token except the newest one, which is fed at the start of
    the next round. Lossless: greedy output equals the target's greedy decoding; sampled output
    has the target's warped distribution, whatever the policy.
    """

    def __init__(self, draft, target, policy: StopPolicy, sampling: SamplingConfig | None = None,
                 profile: bool = False, cascade: Cascade | None = None, fast: str | None = None,
                 capture_rounds: bool | str = True) -> None:
        """``profile=True`` synchronises CUDA around every round's draft and target phases so that
        ``draft_time_s``/``target_time_s`` are measured; without it a CUDA run synchronises only for
        the wall time and reports those two as NaN (on CPU they are measured either way).

        ``cascade``: None (default) decodes exactly; a :class:`~specdecpp.decoders.cascade.Cascade` makes the
        decoding LOSSY: the output follows the cascade's target ``pi`` (specdecpp/decoders/cascade.py), and
        a fully accepted round spends one more draft forward for the bonus token's ``pi``.

        ``fast``: None (default) runs both models eagerly over transformers' cache; ``"static"`` over
        the project's static KV cache, ``"compile"`` with that cache's forwards compiled per width
        bucket (``specdecpp.fast``, docs/engine.md "The fast path"). Sampling, the rule,
        the commit and the policy run outside the compiled forwards either way, so the output is
        the same; in ``generate_batch`` too (a static cache of per-row lengths, forwards padded to
        (batch, width) buckets). ``"graphs"`` / ``"compile-graphs"`` (CUDA): each bucket's forward a
        CUDA graph, and under fixed K or target-only each whole round one graph
        (``capture_rounds``; specdecpp/decoders/replay.py). ``capture_rounds="fused"`` (with
        ``fast="compile-graphs"``) also compiles a captured round's work between its forwards (the
        draws and the rule) with inductor: fewer kernels per round (on an H200, sampled rounds 4-8%
        faster, greedy ones unchanged: docs/results/gpu.md). ``capture_rounds`` takes True (default),
        False or ``"fused"``."""
        if not isinstance(policy, StopPolicy):
            raise TypeError(f"policy must be a StopPolicy (FixedK, SVIP, SpecDecPP, TargetOnly), "
                            f"got {type(policy).__name__}")
        self.draft, self.target, self.policy, self.profile = draft, target, policy, profile
        self.sampling = sampling or SamplingConfig()
        self.vocab = min(output_vocab_size(draft), output_vocab_size(target))
        self.device = check_pair_devices(draft, target)
        self.feature = feature_pair(draft, target)  # a FeatureDraft: it reads the target's features
        if self.feature:
            draft.check_target(target)
        if self.feature and fast in GRAPH_BACKENDS:
            refuse_feature_draft(draft, f"SpeculativeDecoder(fast={fast!r})", "CUDA graphs do not hand it the "
                                 "target's features; decode it with fast='compile', 'static' or None")
        if self.feature and cascade is not None:
            refuse_feature_draft(draft, "a cascade", "its rule reads the draft's logits at the bonus position, "
                                 "where no target feature exists")
        # a feature draft is no transformers model: it keeps its own runner and cache (specdecpp.fast.features)
        static_models = (target,) if self.feature else (draft, target)
        self.fast = check_fast("SpeculativeDecoder", fast, self.device, *static_models)
        self.runners = CallRunners(self.fast, static_models)
        self.cascade = cascade
        if capture_rounds not in (True, False, "fused"):
            raise ValueError(f"capture_rounds must be True, False or 'fused', got {capture_rounds!r}")
        if capture_rounds == "fused" and self.fast != "compile-graphs":
            raise ValueError(f"capture_rounds='fused' compiles a captured round's work between its forwards and "
                             f"needs fast='compile-graphs', got fast={self.fast!r}")
        self.capture_rounds = capture_rounds if capture_rounds == "fused" else bool(capture_rounds)
        self.rule = ExactRule(self.sampling) if cascade is None else CascadeRule(cascade, self.sampling)
        policy.bind(draft, self.sampling.temperature)

    @property
    def drafts(self) -> bool:
        """Whether the draft runs any forward: not under target-only decoding (no candidates), unless
        a cascade's rule reads the draft's logits."""
        return self.policy.max_candidates > 0 or self.rule.lossy

    def fast_plan(self, prompt_len: int, max_new_tokens: int) -> tuple[int, list]:
        """The tokens a call holds (prompt + new tokens + the widest verification + 1) and each
        model's buckets, ``[(draft, buckets), (target, buckets)]``."""
        widest = min(self.policy.max_candidates, max_new_tokens - 1) + 1  # a verification's tokens
        return prompt_len + max_new_tokens + widest + 1, [(self.draft, DRAFT_BUCKETS),
                                                          (self.target, fit_buckets(widest))]

    @decoding
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int = 128, generator: torch.Generator | None = None,
                 eos_token_id: int | Iterable[int] | None = None, return_caches: bool = False,
                 hooks: CallHooks | None = None) -> GenerateOutput:
        """``hooks``: what the caller adds to this call (:class:`~specdecpp.decoders.rounds.CallHooks`:
        logits processing, a stop check, a commit callback; ``specdecpp.hf`` uses them)."""
        gen, clock, marks, seq = start_generate(prompt_ids, max_new_tokens, eos_token_id, generator, self.device,
                                                self.profile, hooks, (self.draft, self.target))
        process = hooks or CallHooks()
        tokens, plan = self.fast_plan(seq.prompt_len, max_new_tokens)
        draft_runners, target_runners = (
            fast_feature_runners(self.draft, self.target, self.runners, tokens, plan[1][1]) if self.feature
            else (self.runners(tokens, plan[0][1]), self.runners(tokens, plan[1][1])))
        drafter = Drafter(self.draft, self.vocab, self.policy, self.sampling, seq.eos, marks,
                          keep_logits=self.rule.lossy, runners=draft_runners)
        target = target_runners(self.target, self.vocab, False)
        stats = RunStats()
        rounds = CapturedRounds(self, drafter, target, hooks, plan[1][1], max_new_tokens)  # decoders/replay.py
        t_start = clock.now()

        with drafter:
            while not seq.finished:
                if not rounds.replay(seq, gen, stats):  # a captured round, replayed and committed; else this:
                    n = seq.n  # committed: seq.tokens[:n]; tokens[n - 1] is in neither cache yet
                    block = drafter.block(seq.tokens, n, min(self.policy.max_candidates, seq.room - 1), gen,
                                          generated=n - seq.prompt_len, process=process.draft_logits)
                    k = block.k
                    logits = target.feed(seq.tokens[target.length : n + k], n_logits=k + 1)[0]  # p_1..p_{K+1}
                    logits = processed(process.target_logits, 0, seq.tokens, list(range(n, n + k + 1)), logits)
                    candidates = drafter.candidates(block, seq.tokens, n)
                    n_acc, token = self.rule(candidates, logits, gen)
                    t_verified = marks.now()
                    kept = seq.commit(n_acc, token, candidates.read)
                    target.rollback(seq.n - 1)
                    drafter.runner.rollback(seq.n - 1)
                    stats.add_round(k + block.extra_forwards, k, n_acc,
                                    k + 1 - kept,  # discarded: k - n_acc, plus after an EOS
                                    block.t1 - block.t0, t_verified - block.t1)
                if stats.n_target_calls == 1:  # the first round's host read is done (its rule's, or a replay's: a
                    stats.first_round_s = clock.now() - t_start  # target-only prompt of one token): no wait on CUDA

        if not marks.exact or stats.replayed_rounds:  # a captured round's draft and target times are not apart
            stats.draft_time_s = stats.target_time_s = float("nan")
        return finish(stats, seq, clock.now() - t_start, drafter.runner, target, return_caches)

    @decoding
    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int = 128,
                       generators: list[torch.Generator | None] | None = None,
                       eos_token_id: int | Iterable[int] | None = None, batch_size: int | None = None,
                       return_caches: bool = False, fill: bool = False,
                       hooks: CallHooks | None = None) -> list[GenerateOutput]:
        """Decode a batch of prompts (1-D LongTensors of any lengths), each row stopping its draft
        at its own candidate length (the policy's ``stop_rows``; a row that stopped waits for the
        others), the target verifying every row's candidates in one forward and each row accepting,
        committing and rolling back on its own (:mod:`specdecpp.decoders.batch`). ``generators[b]`` draws
        row b's samples only, so a row's output does not depend on its batch-mates. At most
        ``batch_size`` rows run at once (None: all); a finished row (EOS, length) leaves the batch
        and the next waiting prompt takes its slot. Returns one :class:`GenerateOutput` per prompt,
        in order; its ``stats.wall_time_s`` is the time from the row's joining to its finish.

        ``fill=True``: a row whose policy stopped keeps drafting while another row's policy still
        drafts, since in this layout its hole would be computed anyway (docs/batch.md); the round
        ends when every row's policy has stopped. Exact either way.

        ``hooks``: as in :meth:`generate`; each hook is told the prompt's index as its row.

        With ``fast`` both models run on :class:`~specdecpp.fast.StaticBatchRunner` (rows
        of their own lengths in a static cache, forwards padded to (batch, width) buckets, each
        compiled once under ``"compile"``; ``warm_up(prompt_len, max_new_tokens, batch_size)``
        compiles them before timing)."""
        return generate_batch(self, prompts, max_new_tokens, generators, eos_token_id, batch_size, return_caches, fill,
                              hooks, feature_runners=batch_feature_runners if self.feature else None)
