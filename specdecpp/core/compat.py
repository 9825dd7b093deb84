"""What differs between the transformers versions this project supports (pyproject's lower bound
to the newest), in one place."""

from __future__ import annotations

import functools
import inspect


@functools.cache
def _cache_argument(model_class: type) -> str:
    """The name a model's forward takes its KV cache under: ``cache`` on transformers 5.x (where
    ``past_key_values`` is deprecated and warns on every call), ``past_key_values`` before."""
    try:
        params = inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``model(ids, **cache_kwargs(model, cache))`` passes ``cache`` under the name this
    transformers version wants."""
    return {_cache_argument(type(model)): cache}
