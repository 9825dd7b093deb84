"""Functions of a library swapped for others while a block runs: what the compile-time patches of the
fast path share (:mod:`~specdecpp.models.codegen_memo`, :mod:`~specdecpp.models.packed_cache`).

A :class:`PatchSet` asks its ``make`` for the (owner, attribute, original, replacement) it can apply
to the installed library (each module checks that the function it replaces exists with the signature
it expects, and lists nothing otherwise), applies them when the outermost block is entered and puts
the originals back when it ends, after an error too. Nested or concurrent blocks patch once.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable

_LOCK = threading.Lock()  # one patcher at a time, whichever set


def takes_arguments(fn, n: int) -> bool:
    """Whether ``fn`` has exactly ``n`` parameters (False where its signature cannot be read)."""
    try:
        return len(inspect.signature(fn).parameters) == n
    except (TypeError, ValueError):
        return False


class PatchSet:
    """The patches ``make()`` lists, applied while a block of :meth:`applied` runs (module docstring)."""

    def __init__(self, make: Callable[[], list[tuple[object, str, object, object]]],
                 enabled: Callable[[], bool]) -> None:
        self.make, self.enabled, self.depth = make, enabled, 0

    @contextlib.contextmanager
    def applied(self, on: bool | None = None):
        """The patches applied while the block runs. ``on``: None follows ``enabled()``; False does nothing."""
        if not (self.enabled() if on is None else on):
            yield
            return
        with _LOCK:
            patches = self.make() if self.depth == 0 else []
            for owner, name, _, replacement in patches:
                setattr(owner, name, replacement)
            self.depth += 1
        try:
            yield
        finally:
            with _LOCK:
                self.depth -= 1
                for owner, name, original, _ in patches:
                    setattr(owner, name, original)
