"""The runners' forward-pass meters: how long each model spent in its forward passes during one
decode (``forward_time_s`` of a row), read on the library's clock (``specdecpp.core.timing.Clock``):
through forward hooks for the eager runners (:class:`ForwardMeter`), around the static runners'
steps for the fast path, whose steps bypass the hooks (:class:`FeedMeters`)."""

from __future__ import annotations

from specdecpp.core.timing import Clock
from specdecpp.fast.runners import StaticModel


class ForwardMeter:
    """Counts and times the forward passes of one model through hooks (a context manager);
    ``on_call`` runs before each pass. ``enabled=False`` installs no hook (the fast path's steps
    call the model's decoder and output layer, not its forward, and a hook inside a compiled step
    would break its graph): the meter then counts nothing."""

    def __init__(self, model, clock: Clock, on_call=None, enabled: bool = True) -> None:
        self.model, self.clock, self.on_call, self.enabled = model, clock, on_call, enabled
        self.calls, self.seconds, self._start, self.handles = 0, 0.0, 0.0, []

    def __enter__(self) -> ForwardMeter:
        if self.enabled:
            self.handles = [self.model.register_forward_pre_hook(self._pre),
                            self.model.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, module, args):
        if self.on_call is not None:
            self.on_call()
        self._start = self.clock.now()

    def _post(self, module, args, output):
        self.seconds += self.clock.now() - self._start
        self.calls += 1


PHASES = ("prefill", "round")  # a runner's first feed of a call (the prompt) and every later one
# a whole feed; inside it the model's forward step and (static) its mask (a chain: its stored inputs)
PARTS = ("feed", "step", "mask")


class FeedMeters:
    """A decoder's runner factory (its ``runners``: ``specdecpp.fast.calls.CallRunners``) whose
    runners time their work from outside, on ``clock``: every ``feed``, and inside a static
    runner's feed its forward step (compiled or eager) and its mask (built, or a chain's taken from the
    store of :meth:`~specdecpp.fast.runners.StaticRunner.chain_inputs`). A runner's first feed
    of a call is the ``prefill`` (the prompt, and for the target the first round's verification
    with it), every later one a ``round`` feed. ``seconds[(role, phase, part)]`` sums them over
    calls; ``role`` is ``roles[id(model)]`` ("draft", "target"). Everything else is passed through,
    so a decoder runs unchanged with ``decoder.runners = FeedMeters(decoder.runners, ...)``.

    The wrappers cost two clock readings per timed call (about 0.2 us each on a CPU), not counted
    anywhere but in the loop's own time."""

    def __init__(self, runners, roles: dict[int, str], clock: Clock) -> None:
        self.inner, self.roles, self.clock = runners, roles, clock
        self.seconds: dict[tuple[str, str, str], float] = {}
        self.calls: dict[tuple[str, str, str], int] = {}

    def __call__(self, *args, **kwargs):
        make = self.inner(*args, **kwargs)

        def timed(model, vocab: int, want_hidden: bool):
            return TimedRunner(make(model, vocab, want_hidden), self.roles.get(id(model), "model"), self)

        return timed

    def __getattr__(self, name):  # warm_up, fast, size, ...: the wrapped factory's
        return getattr(self.inner, name)

    def add(self, key: tuple[str, str, str], seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.calls[key] = self.calls.get(key, 0) + 1

    def total(self, phase: str | None = None, part: str = "feed", role: str | None = None,
              seconds: dict | None = None) -> float:
        """Seconds of ``part`` summed over the matching keys of ``seconds`` (default: all so far)."""
        seconds = self.seconds if seconds is None else seconds
        return sum(s for (r, p, q), s in seconds.items()
                   if q == part and (phase is None or p == phase) and (role is None or r == role))

    def forwards(self, role: str, phase: str = "round", seconds: dict | None = None) -> float:
        """A model's forward seconds: its steps where its runner has them (fast), else its whole feeds (eager)."""
        return self.total(phase, "step", role, seconds) or self.total(phase, "feed", role, seconds)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class TimedRunner:
    """One runner whose ``feed`` the :class:`FeedMeters` time, and inside a static runner's feed its
    step and mask, through the runner's public timing hook (``meter``,
    :class:`specdecpp.fast.runners.StaticModel`); the runner's code and methods are not changed."""

    def __init__(self, runner, role: str, meters: FeedMeters) -> None:
        self.runner, self.role, self.meters, self.phase = runner, role, meters, "prefill"
        self._feed = self._timed(runner.feed, "feed")
        if isinstance(runner, StaticModel):  # the fast path's runners (an eager one's forwards: ForwardMeter)
            runner.meter = self._part

    def _part(self, part: str, fn, *args):
        """The runner's ``meter``: ``fn(*args)`` timed into ``part``; a forward step is called through
        :func:`run_forward_step`, so a profile tells the forwards' callees from the loop's
        (scripts/bench_fast.py)."""
        clock = self.meters.clock
        t0 = clock.now()
        out = run_forward_step(fn, *args) if part == "step" else fn(*args)
        self.meters.add((self.role, self.phase, part), clock.now() - t0)
        return out

    def _timed(self, fn, part: str):
        """``fn`` timed into ``part``."""
        clock, meters = self.meters.clock, self.meters

        def call(*args, **kwargs):
            t0 = clock.now()
            out = fn(*args, **kwargs)
            meters.add((self.role, self.phase, part), clock.now() - t0)
            return out

        return call

    def feed(self, *args, **kwargs):
        out = self._feed(*args, **kwargs)
        self.phase = "round"
        return out

    def __enter__(self):
        self.runner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.runner.__exit__(*exc)

    def __getattr__(self, name):  # length, cache, rollback, compact, ...
        return getattr(self.runner, name)


def run_forward_step(step, *args, **kwargs):
    """Calls a static runner's forward step (:class:`TimedRunner`): a function of its own name, the
    root of the forwards in a profile."""
    return step(*args, **kwargs)
