"""Round 3's module paths, kept importable for one release after the layout moved them.

``from specdecpp.head import NextTokenHead`` (round 3) still works: importing a moved path warns
once per process (a DeprecationWarning naming the new path and the release that removes it), and
every name it gives is the new module's own object. Where round 3's module was split, its names
are looked up in each new home in turn; two names that were renamed say so when read.
docs/api.md, "Moved modules", lists them. Remove this module and its import in ``__init__`` in
:data:`REMOVED_IN` (tests/test_moved_paths.py fails once the version reaches it).

One finder on ``sys.meta_path`` answers for ``specdecpp.<old>`` only (a real module of that name
always wins: the finder comes last), so the package's folders show only its layers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

REMOVED_IN = "0.2.0"  # the release without these paths
# round 3's module specdecpp.<old> -> the modules its names live in now (looked up in this order)
MOVED: dict[str, tuple[str, ...]] = {
    "batch": ("specdecpp.decoders.batch",),
    "cascade": ("specdecpp.decoders.cascade",),
    "compat": ("specdecpp.core.compat",),
    "costmodel": ("specdecpp.analysis.costmodel",),
    "dataset": ("specdecpp.data.dataset",),
    "engine": ("specdecpp.decoders.chain", "specdecpp.decoders.rounds"),
    "head": ("specdecpp.stopping.head",),
    "head_metrics": ("specdecpp.training.metrics",),
    "hooks": ("specdecpp.core.hooks",),
    "identity": ("specdecpp.models.identity",),
    "jsonfile": ("specdecpp.core.jsonfile",),
    "labels": ("specdecpp.data.labels",),
    "loading": ("specdecpp.models.loading",),
    "loss": ("specdecpp.training.loss",),
    "mixing": ("specdecpp.training.mixing",),
    "pearl": ("specdecpp.decoders.pearl",),
    "policies": ("specdecpp.stopping.policies",),
    "potential": ("specdecpp.analysis.potential",),
    "prompts": ("specdecpp.data.prompts",),
    "quality": ("specdecpp.analysis.quality",),
    "reduced_vocab": ("specdecpp.models.reduced_vocab",),
    "rounds": ("specdecpp.decoders.rounds", "specdecpp.models.runner", "specdecpp.core.timing",
               "specdecpp.core.attention"),
    "sampling": ("specdecpp.core.sampling",),
    "schedules": ("specdecpp.training.schedules",),
    "sequoia": ("specdecpp.decoders.sequoia",),
    "stats": ("specdecpp.analysis.stats",),
    "tasks": ("specdecpp.data.tasks",),
    "timing": ("specdecpp.core.timing",),
    "tree": ("specdecpp.decoders.tree",),
    "tree_search": ("specdecpp.analysis.tree_search",),
    "verify": ("specdecpp.core.verify",),
}
# (old module, old name) -> its name now (in the old module's new homes)
RENAMED = {("rounds", "Sequence"): "TokenBuffer", ("tasks", "run_check_subprocess"): "run_check"}


class MovedModule(types.ModuleType):
    """``specdecpp.<old>``: each name is read from the new modules (:data:`MOVED`)."""

    def __init__(self, old: str):
        super().__init__(f"specdecpp.{old}", f"Deprecated: moved to {', '.join(MOVED[old])} (removed in "
                                             f"{REMOVED_IN}; docs/api.md, 'Moved modules').")
        self._old, self._homes = old, MOVED[old]

    def _lookup(self, name: str):
        for home in self._homes:
            module = importlib.import_module(home)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} (moved to {', '.join(self._homes)}) has no attribute {name!r}")

    def __getattr__(self, name: str):
        if name == "__all__":  # for ``import *``: the public names of the new homes
            return sorted({n for home in self._homes for n, v in vars(importlib.import_module(home)).items()
                           if not n.startswith("_") and not isinstance(v, types.ModuleType)})
        if name.startswith("__"):
            raise AttributeError(name)
        new = RENAMED.get((self._old, name))
        if new is None:
            return self._lookup(name)
        warnings.warn(f"{self.__name__}.{name} is now {name_of(self._lookup(new))} (removed in {REMOVED_IN}; "
                      "docs/api.md, 'Moved modules')", DeprecationWarning, stacklevel=2)
        return self._lookup(new)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self.__all__))

    def __call__(self, *args, **kwargs):
        """``specdecpp.verify`` is the package's function and was round 3's module: importing the
        module path makes the package attribute this module, which still calls the function."""
        return self._lookup(self._old)(*args, **kwargs)


def name_of(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads ``specdecpp.<old>`` for the names in :data:`MOVED`."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package != "specdecpp" or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return MovedModule(spec.name.rpartition(".")[2])

    def exec_module(self, module):
        homes = " and ".join(module._homes)
        warnings.warn(f"{module.__name__} is deprecated: import from {homes} (the library's layout; the old "
                      f"path goes in specdecpp {REMOVED_IN}, docs/api.md, 'Moved modules')", DeprecationWarning,
                      stacklevel=2)  # the import statement: warnings skips the import machinery's frames
        for home in module._homes:  # a broken new home fails the import, not a later attribute
            importlib.import_module(home)


def install() -> None:
    """Put the finder last on ``sys.meta_path`` (once, whatever reloads happen)."""
    if not any(type(f).__name__ == MovedFinder.__name__ and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())


install()
