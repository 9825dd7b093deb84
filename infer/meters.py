"""The runners' forward-pass meter: how long each model spent in its forward passes during one
decode (``forward_time_s`` of a row), read on the library's clock (``specdecpp.core.timing.Clock``)
through forward hooks, the same for every runner."""

from __future__ import annotations

from specdecpp.core.timing import Clock


class ForwardMeter:
    """Counts and times the forward passes of one model through hooks (a context manager);
    ``on_call`` runs before each pass."""

    def __init__(self, model, clock: Clock, on_call=None) -> None:
        self.model, self.clock, self.on_call = model, clock, on_call
        self.calls, self.seconds, self._start, self.handles = 0, 0.0, 0.0, []

    def __enter__(self) -> ForwardMeter:
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
