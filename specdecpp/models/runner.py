"""One model and its KV cache: feed tokens, roll back by cropping, compact a tree's accepted path,
read the final hidden state. Every decoder drives its models through a runner, so what a decoding
forward costs is timed through one too (:func:`time_cached_forwards`)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from ..core.attention import decode_attention
from ..core.compat import cache_kwargs
from ..core.hooks import FinalHidden, crop_to, keep_last, new_cache
from ..core.timing import time_forwards
from .reduced_vocab import output_vocab_size

# Token counts a CPU forward is padded to (a multiple of; see ModelRunner.feed). 1 turns padding off.
CPU_TOKEN_MULTIPLE = 4


class HiddenHook:
    """A runner's final-hidden-state hook (``self.final``, a :class:`FinalHidden` or None) as a
    context manager, so the hook is removed when the runner is done (chain and batch runners)."""

    final: FinalHidden | None = None

    def ready(self, start: int) -> bool:
        """Whether the model can draft after ``seq[:start]`` (a plain model always can; a feature
        draft once the target has read the tokens before: specdecpp/models/feature_runner.py)."""
        return True

    def __enter__(self):
        if self.final is not None:
            self.final.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.final is not None:
            self.final.__exit__(*exc)


class ModelRunner(HiddenHook):
    """One model and its KV cache. ``length`` tokens are cached; rollback = crop. With
    ``want_hidden`` the final hidden state is captured by a hook (:class:`FinalHidden`), never
    every layer's; use it as a context manager so the hook is removed."""

    def __init__(self, model, vocab: int, want_hidden: bool) -> None:
        self.model, self.vocab, self.want_hidden = model, vocab, want_hidden
        self.cache = new_cache(model)
        self.final = FinalHidden(model) if want_hidden else None

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def feed(self, ids: torch.Tensor, n_logits: int = 1, position_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None):
        """Append ``ids`` [n] to the cache; return logits [n_logits, V] (and hidden [n_logits, H]).

        By default the new tokens follow the cache causally. A token tree passes ``position_ids``
        [n] and ``attention_mask``, a boolean [n, length + n] (True: the row's token may attend to
        that cache position or new token), which is given to the model as a 4-D additive mask.

        On CPU, n > 1 tokens are padded to a multiple of ``CPU_TOKEN_MULTIPLE`` with copies of the
        last token, which are cropped from the cache again: the CPU GEMM kernels are slower for 2-3
        rows than for 4 (and 5-7 than 8), so an unpadded forward over 2-3 tokens costs more than
        over 4 (scripts/bench_verify_cost.py). Causal attention keeps the real positions exact (with
        a mask, no real token attends to the padding)."""
        n = ids.shape[0]
        pad = (-n) % CPU_TOKEN_MULTIPLE if n > 1 and ids.device.type == "cpu" else 0
        if pad:
            ids = torch.cat([ids, ids[-1:].expand(pad)])
        kwargs = dict(self.final.kwargs) if self.final is not None else {}
        if position_ids is not None:
            kwargs["position_ids"] = torch.cat([position_ids, position_ids[-1:].expand(pad)]).unsqueeze(0)
        if attention_mask is not None:
            kwargs["attention_mask"] = self._mask4d(attention_mask, pad)
        out = self.model(ids.unsqueeze(0), use_cache=True, **cache_kwargs(self.model, self.cache),
                         logits_to_keep=keep_last(n + pad, n_logits + pad, ids.device), **kwargs)
        end = out.logits.shape[1] - pad
        logits = out.logits[0, end - n_logits : end, : self.vocab]
        hidden = self.final.take(out)[0, -n_logits - pad :][:n_logits] if self.final is not None else None
        if pad:
            self.cache.crop(-pad)
        return logits, hidden

    def _mask4d(self, allowed: torch.Tensor, pad: int) -> torch.Tensor:
        """A boolean [n, length + n] mask as the model's 4-D additive one [1, 1, n + pad, length +
        n + pad]: padding rows repeat the last real row and see themselves; no real row sees them."""
        n, width = allowed.shape
        if width != self.length + n:
            raise ValueError(f"attention_mask must be [n, cached + n] = [{n}, {self.length + n}], "
                             f"got {tuple(allowed.shape)}")
        if pad:
            allowed = torch.cat([allowed, allowed[-1:].expand(pad, width)])
            allowed = torch.cat([allowed, torch.eye(n + pad, dtype=torch.bool, device=allowed.device)[:, n:]], dim=1)
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]

    def compact(self, keep) -> None:
        """Keep only the cached positions ``keep`` (strictly increasing), in that order: a token
        tree's accepted path moves next to the prefix. Positions before the first gap stay put."""
        keep = [int(k) for k in keep]
        if (any(b <= a for a, b in zip(keep, keep[1:], strict=False))
                or (keep and (keep[0] < 0 or keep[-1] >= self.length))):
            raise ValueError(f"compact: keep must be strictly increasing cache positions < {self.length}, got {keep}")
        first = next((i for i, k in enumerate(keep) if k != i), len(keep))
        if first < len(keep):
            src = torch.tensor(keep[first:], device=self.cache.layers[0].keys.device)
            for layer in self.cache.layers:
                check_plain_layer(layer)
                for name in ("keys", "values"):
                    kv = getattr(layer, name)
                    kv[..., first : len(keep), :] = kv.index_select(-2, src)
        self.rollback(len(keep))

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (no-op if fewer are cached)."""
        crop_to(self.cache, length)

    def kept_cache(self):
        """The cache a call hands out (``return_caches=True``): this runner's own; no later call uses it."""
        return self.cache


def check_plain_layer(layer) -> None:
    """Compaction rewrites a cache layer's ``keys``/``values`` in place, which is right for
    transformers' plain ``DynamicLayer`` only (a sliding window or an indexed layer keeps more)."""
    from transformers.cache_utils import DynamicLayer

    plain = isinstance(layer, DynamicLayer) and all(
        getattr(type(layer), m) is getattr(DynamicLayer, m) for m in ("crop", "get_seq_length", "update"))
    if not plain:
        raise ValueError(f"this model's KV cache has {type(layer).__name__} layers; a token tree needs transformers' "
                         "plain DynamicLayer (no sliding window, no hybrid or indexed layers)")


def time_cached_forwards(models: Mapping[Hashable, torch.nn.Module], prefix: torch.Tensor, tail: torch.Tensor,
                         widths: Mapping[Hashable, Sequence[int]] | None = None, *, repeats: int = 20,
                         warmup: int = 3) -> dict[Hashable, dict[int, float]]:
    """Median seconds of one cached forward of n tokens, batch 1, per model: ``tail[:n]`` fed after
    ``prefix`` (1-D token ids) through the decoders' own call (:meth:`ModelRunner.feed`, which pads
    2-3 tokens to 4 on a CPU as decoding does), for n = 1 and ``widths[key]``. The cache is rolled
    back (untimed) after each call; every (model, n) is timed in turn in each step
    (:func:`~specdecpp.core.timing.time_forwards`: CUDA-synchronised, interleaved so that machine
    load touches all alike), under the attention kernels decoding uses. Returns ``{key: {n: s}}``."""
    widths = widths or {}
    unknown = set(widths) - set(models)
    if unknown:
        raise ValueError(f"time_cached_forwards: widths for unknown models {sorted(map(str, unknown))}")
    if prefix.dim() != 1 or tail.dim() != 1 or prefix.shape[0] == 0:
        raise ValueError(f"time_cached_forwards: prefix and tail must be 1-D token ids, the prefix not empty; got "
                         f"{tuple(prefix.shape)} and {tuple(tail.shape)}")
    widest = max([1, *(n for ns in widths.values() for n in ns)])
    if widest > tail.shape[0]:
        raise ValueError(f"time_cached_forwards: a tail of {tail.shape[0]} tokens cannot feed {widest} at once")
    calls, resets = {}, {}
    with torch.no_grad():
        for key, model in models.items():
            runner = ModelRunner(model, output_vocab_size(model), want_hidden=False)
            runner.feed(prefix.to(model.device))
            length, tokens = runner.length, tail.to(model.device)
            for n in dict.fromkeys([1, *widths.get(key, ())]):
                calls[(key, n)] = lambda r=runner, t=tokens[:n], n=n: r.feed(t, n_logits=n)
                resets[(key, n)] = lambda r=runner, length=length: r.rollback(length)
        with decode_attention(next(iter(models.values())).device):
            timed = time_forwards(calls, repeats=repeats, warmup=warmup, resets=resets)
    out: dict[Hashable, dict[int, float]] = {}
    for (key, n), timing in timed.items():
        out.setdefault(key, {})[n] = timing.median
    return out
