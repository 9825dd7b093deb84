"""A decoder's runners by one switch, ``fast`` (:func:`new_runner` for one runner,
:class:`CallRunners` across a decoder's calls): sized so that calls of other lengths share a cache
size and with it the compiled steps, and warmed up (every bucket compiled or captured) before
anything is timed (docs/engine.md, "One cache size across calls")."""

from __future__ import annotations

import functools
import time

import torch
from tqdm import tqdm

from ..core.attention import decode_attention
from ..models.runner import ModelRunner
from .batch_runner import StaticBatchRunner
from .buckets import (
    BATCH_BUCKETS,
    BUCKETED_BACKENDS,
    TARGET_BUCKETS,
    call_max_len,
    check_buckets,
    fit_buckets,
)
from .runners import StaticRunner


def new_runner(model, vocab: int, want_hidden: bool, fast: str | None = None, *, max_len: int | None = None,
               buckets: tuple[int, ...] = TARGET_BUCKETS, cover: bool = True):
    """The runner the ``fast`` switch chooses (docs/engine.md, "The fast path"): ``None`` gives the eager
    :class:`ModelRunner`, ``"static"`` / ``"compile"`` / ``"graphs"`` / ``"compile-graphs"`` a :class:`StaticRunner`."""
    if fast is None:
        return ModelRunner(model, vocab, want_hidden)
    return StaticRunner(model, vocab, want_hidden, fast=fast, max_len=max_len, buckets=buckets, cover=cover)


class CallRunners:
    """A decoder's runners across its calls, by one switch ``fast``: ``runners(tokens, buckets)``
    is a factory ``(model, vocab, want_hidden) -> runner`` for a call that holds at most ``tokens``
    tokens and feeds widths up to ``buckets[-1]`` in buckets (eager :class:`ModelRunner` for
    ``fast=None``). The static caches' size is the largest any call of this decoder has needed so
    far (:func:`call_max_len` of the tokens plus the padding tail, so the size does not depend on
    the buckets): a call that fits reuses it, and with it the compiled steps of every model and
    width. :meth:`warm_up` compiles every bucket at a call's size before anything is timed.
    ``cover=False``: every forward runs in its own bucket, compiled on first use, never in a
    compiled larger one (docs/engine.md, "Buckets that have not compiled yet"): what a tool that times
    each bucket's own forward needs."""

    def __init__(self, fast: str | None, models, cover: bool = True) -> None:
        self.fast, self.models, self.size, self.cover = fast, tuple(models), 0, cover

    def _max_len(self, tokens: int, buckets: tuple[int, ...]) -> int:
        need = tokens + buckets[-1]
        if need > self.size:
            self.size = max(call_max_len(need, model) for model in self.models)
        return self.size - buckets[-1]

    def __call__(self, tokens: int, buckets: tuple[int, ...] = TARGET_BUCKETS):
        sizing = self.sizing(tokens, buckets)

        def make(model, vocab: int, want_hidden: bool):
            return new_runner(model, vocab, want_hidden, self.fast, **sizing)

        return make

    def sizing(self, tokens: int, buckets: tuple[int, ...] = TARGET_BUCKETS) -> dict:
        """The keywords a :class:`StaticRunner` of a call of ``tokens`` tokens and ``buckets`` takes
        besides ``fast`` (``max_len``, ``buckets``, ``cover``; ``max_len`` None under ``fast=None``)."""
        buckets = check_buckets(buckets)
        max_len = None if self.fast is None else self._max_len(tokens, buckets)
        return {"max_len": max_len, "buckets": buckets, "cover": self.cover}

    def batch(self, tokens: int, buckets: tuple[int, ...] = TARGET_BUCKETS, rows: int = 1, eager=None,
              static=StaticBatchRunner):
        """As calling it, for a batch: a factory ``(model, vocab, want_hidden) -> runner`` for a
        call whose rows hold at most ``tokens`` tokens each, at most ``rows`` of them at once:
        ``eager`` (the decoders' ``BatchRunner``, which this layer cannot import) for ``fast=None``,
        else ``static`` (:class:`StaticBatchRunner`, or a class that extends it, its own arguments
        bound) of the decoder's cache size."""
        buckets = check_buckets(buckets)
        if self.fast is None:
            if eager is None:
                raise ValueError("CallRunners.batch: fast=None needs the eager batch runner (eager=BatchRunner)")
            return eager
        return functools.partial(static, fast=self.fast, max_len=self._max_len(tokens, buckets),
                                 buckets=buckets, rows=rows, cover=self.cover)

    def warm_up(self, tokens: int, plan, rows: int | None = None, progress: bool = False, static=None) -> float:
        """Compile each model's buckets ``plan`` [(model, buckets), ...] for a call of ``tokens``
        tokens (one forward of each width; the steps are kept for the process) unless compiled
        already; with ``rows``, those of a batch call of at most ``rows`` rows at once instead
        (every batch bucket up to the one that holds ``rows``, times every width). Returns the
        seconds it took (0 unless ``fast`` compiles or captures: "compile", "graphs", "compile-graphs").
        ``progress``: a progress bar over the steps (a tuned target bucket compiles for minutes on a CPU).
        ``static``: the runner class to warm instead of :class:`StaticRunner` (with ``rows``:
        :class:`StaticBatchRunner`), its own arguments bound: a feature pair's target runner, whose
        steps also return the features (:mod:`specdecpp.fast.features`)."""
        if self.fast not in BUCKETED_BACKENDS:
            return 0.0
        t0 = time.perf_counter()
        total = sum(len(buckets) * (1 if rows is None else len(fit_buckets(rows, BATCH_BUCKETS)))
                    for _, buckets in plan)
        what = "capturing" if self.fast == "graphs" else "compiling"
        with torch.no_grad(), decode_attention(self.models[0].device), \
                tqdm(total=total, desc=f"fast={self.fast}: {what} steps", unit="step", disable=not progress) as bar:
            # (autograd off and the decoding attention: the state decoding compiles under)
            for model, buckets in plan:
                runner = None  # under graphs, the last model's runner releases its buffers before the next leases
                name = type(model).__name__
                if rows is None:
                    runner = (static or StaticRunner)(model, 1, False, fast=self.fast, **self.sizing(tokens, buckets))
                    runner.cover = False  # every bucket its own step
                    for width in runner.buckets:
                        bar.set_postfix_str(f"{name} width {width}")
                        runner.rollback(0)
                        runner.feed(torch.zeros(width, dtype=torch.long, device=runner.device))
                        bar.update()
                    continue
                runner = self.batch(tokens, buckets, rows, static=static or StaticBatchRunner)(model, 1, False)
                runner.cover = False  # every bucket its own step
                for batch in fit_buckets(rows, runner.batch_buckets):
                    runner.select([])
                    runner.add_rows([torch.zeros(0, dtype=torch.long, device=runner.device)] * batch)
                    for width in runner.buckets:
                        bar.set_postfix_str(f"{name} batch {batch} width {width}")
                        runner.rollback([0] * batch)
                        runner.feed([torch.zeros(width, dtype=torch.long, device=runner.device)] * batch)
                        bar.update()
        return time.perf_counter() - t0
