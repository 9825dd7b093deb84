"""The runners' forward-pass meter: how long each model spent in its forward passes during one
decode (``forward_time_s`` of a row), read on the library's clock (``specdecpp.core.timing.Clock``)
through forward hooks, the same for every runner."""

from __future__ import annotations

from specdecpp.core.timing import Clock


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
