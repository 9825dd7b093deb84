"""Portable model identities: what a saved head or dataset records about its models.

A record must resolve on another machine, so it names a model by one of:

- a hub id (``org/model``), loaded as any hub id is;
- a portable identity ``name@digest``: a name plus a content hash (``my-draft@3f2a...``). A model
  directory carries its identity in :data:`IDENTITY_FILE` (:func:`write_identity`); whoever makes
  such directories registers a *resolver* for the name, a function ``identity -> local directory``
  (materialising it if needed), either in Python (:func:`register_resolver`) or as an entry point
  in the group :data:`ENTRY_POINT_GROUP` (``[project.entry-points."specdecpp.model_resolvers"]``,
  ``<name> = "package.module:function"``), found on first use.

Every loader (:func:`specdecpp.models.loading.load_pair` and friends) resolves an identity before loading,
so ``load_pair(draft="my-draft@3f2a...", ...)`` works wherever a resolver for ``my-draft`` is
installed, and says what to pass instead where none is. :func:`portable_name` is what writers
record: the identity of a stamped directory, a hub id as given; a plain local directory has no
portable name and is recorded as given (stamp it with :func:`write_identity` to make it portable).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

IDENTITY_FILE = "specdecpp_identity.json"  # {"identity": "name@digest"} in a model directory
ENTRY_POINT_GROUP = "specdecpp.model_resolvers"

_IDENTITY = re.compile(r"^(?P<name>[A-Za-z0-9][\w.-]*)@(?P<digest>[\w.:-]+)$")
_RESOLVERS: dict[str, Callable[[str], str | os.PathLike]] = {}

Resolver = Callable[[str], "str | os.PathLike"]


def parse_identity(ref: str) -> tuple[str, str] | None:
    """``"name@digest"`` -> ``(name, digest)``; None for anything else (paths, hub ids)."""
    match = _IDENTITY.match(str(ref))
    return (match["name"], match["digest"]) if match else None


def register_resolver(name: str, resolver: Resolver) -> None:
    """Resolve identities ``name@...`` with ``resolver(identity) -> local model directory``. The
    directory must carry that identity (:func:`write_identity`); a resolver that cannot provide the
    requested digest raises (LookupError, FileNotFoundError or ValueError) saying why."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name):
        raise ValueError(f"register_resolver: name must be a model name without '@' or '/', got {name!r}")
    if not callable(resolver):
        raise TypeError(f"register_resolver({name!r}, ...): the resolver must be callable, got {resolver!r}")
    _RESOLVERS[name] = resolver


def unregister_resolver(name: str) -> None:
    _RESOLVERS.pop(name, None)


def _entry_points():
    from importlib.metadata import entry_points

    return entry_points(group=ENTRY_POINT_GROUP)


def _entry_point_resolver(name: str) -> Resolver | None:
    for ep in _entry_points():
        if ep.name == name:
            return ep.load()
    return None


def find_resolver(name: str) -> Resolver | None:
    """The resolver for ``name``: registered in Python, else an installed entry point."""
    if name not in _RESOLVERS:
        found = _entry_point_resolver(name)
        if found is None:
            return None
        _RESOLVERS[name] = found
    return _RESOLVERS[name]


def write_identity(directory: str | os.PathLike, identity: str) -> Path:
    """Stamp a model directory with its portable identity (``name@digest``)."""
    if parse_identity(identity) is None:
        raise ValueError(f"a model identity is 'name@digest' (a name plus a content hash), got {identity!r}")
    path = Path(directory) / IDENTITY_FILE
    path.write_text(json.dumps({"identity": identity}, indent=1) + "\n")
    return path


def model_identity(ref: str | os.PathLike) -> str | None:
    """The portable identity of a model reference: read from a stamped directory's
    :data:`IDENTITY_FILE`, or the reference itself when it is an identity; else None."""
    path = Path(os.path.expanduser(str(ref)))
    stamp = path / IDENTITY_FILE
    if stamp.is_file():
        try:
            identity = json.loads(stamp.read_text()).get("identity")
        except (ValueError, AttributeError):
            return None
        return identity if isinstance(identity, str) and parse_identity(identity) else None
    if not path.exists() and parse_identity(str(ref)) is not None:
        return str(ref)
    return None


def portable_name(ref: str | os.PathLike | None) -> str | None:
    """What a record names a model by: its identity where it has one, else the reference as given
    (a hub id is portable as it is; a plain local path is not, and stays as given)."""
    if ref is None:
        return None
    return model_identity(ref) or str(ref)


def resolve_model(ref: str) -> str:
    """A reference the loaders can open: an existing path, a hub id or anything that is not an
    identity comes back unchanged; an identity ``name@digest`` comes back as the local directory
    its name's resolver provides (checked to carry that identity)."""
    ref = str(ref)
    if Path(os.path.expanduser(ref)).exists():
        return ref
    parsed = parse_identity(ref)
    if parsed is None:
        return ref
    name = parsed[0]
    instead = ("Pass the model's local directory or hub id instead (pair.draft=PATH / pair.target=PATH, "
               "or load_pair(draft=..., target=...))")
    resolver = find_resolver(name)
    if resolver is None:
        known = sorted(set(_RESOLVERS) | {ep.name for ep in _entry_points()})
        raise FileNotFoundError(
            f"model {ref!r} is a portable identity (name {name!r} plus a content hash) and no resolver for "
            f"{name!r} is registered here (known: {known or 'none'}). {instead}, or install the package that "
            f"provides {name!r} (it registers a resolver in the entry-point group {ENTRY_POINT_GROUP!r}, or "
            "call specdecpp.register_resolver in Python)")
    try:
        directory = resolver(ref)
    except (LookupError, FileNotFoundError, ValueError) as exc:
        raise FileNotFoundError(f"model {ref!r}: the resolver for {name!r} cannot provide it: {exc}. "
                                f"{instead}") from exc
    found = model_identity(directory) if directory is not None else None
    if found != ref:
        raise FileNotFoundError(f"model {ref!r}: the resolver for {name!r} returned {str(directory)!r}, which is "
                                f"{found or 'not a stamped model directory'!r}, not the model asked for. {instead}")
    return str(directory)


def model_key(ref: str | os.PathLike) -> str:
    """One text per model for grouping records, as :func:`same_model` compares: the identity where the
    reference has one, an existing local path resolved, anything else (a hub id) as given."""
    identity = model_identity(ref)
    if identity is not None:
        return identity
    path = Path(os.path.expanduser(str(ref)))
    return str(path.resolve()) if path.exists() else str(ref).rstrip("/")


def same_model(a: str, b: str) -> bool:
    """Whether two model references name the same model: by identity where either side has one (a
    stamped directory against its identity, or two copies of one model), local paths compared
    resolved (a symlink, ``~`` or a trailing slash names the same directory), other references
    (hub ids) as text."""
    return model_key(a) == model_key(b)
