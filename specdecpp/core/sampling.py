"""Sampling math shared by data_gen labels, every stop policy and the engine.

One function, :func:`warp`, turns raw logits into the distribution that is actually sampled
from. Data generation labels, the verification step and the engine all call it, so the ``p``
(target) and ``q`` (draft) used anywhere in the project are always the warped distributions.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are sampled.

    temperature: 0 means greedy (argmax); > 0 divides the logits.
    top_k: keep the k most likely tokens; 0 (or k >= vocabulary size) means no truncation.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 means off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0
                and math.isfinite(self.temperature)):
            raise ValueError(f"SamplingConfig.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"SamplingConfig.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_mapping(cls, m) -> SamplingConfig:
        """Build from any mapping (a dict or an OmegaConf node) with the three keys."""
        return cls(temperature=float(m.get("temperature", 1.0)), top_k=int(m.get("top_k", 0)),
                   top_p=float(m.get("top_p", 1.0)))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of the largest value over the last dimension, the first of ties (``max(-1).indices``;
    for bf16 on a CPU 4x faster than ``argmax``). A float32 or float64 tensor on a CPU goes through
    numpy's vectorised argmax: 8 us against torch's 100-120 us over a 49k vocabulary on one thread
    (torch's index-tracking reductions are not vectorised there; docs/results/fast.md)."""
    # numpy reads the host: not inside a compiled region (a fused round)
    if (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad
            and not torch.compiler.is_compiling()):
        return torch.from_numpy(np.asarray(np.argmax(logits.numpy(), axis=-1)))
    return logits.max(-1).indices


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Return the probabilities actually sampled from, over the last dimension.

    Greedy (temperature 0) gives a one-hot distribution on the argmax, so the stochastic
    verification rule reduces exactly to greedy verification. Otherwise: divide by the
    temperature, keep the top-k logits, keep the top-p nucleus, softmax. Computed in float32. On a
    CPU, top-k alone over a large vocabulary takes :func:`_top_k_softmax`'s way to the same result.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).to(logits.dtype)
    if cfg.temperature != 1.0:  # x / 1.0 is x: a pass over the vocabulary saved
        logits = logits / cfg.temperature
    vocab = logits.shape[-1]
    if _sparse_top_k(logits, cfg):
        return _top_k_softmax(logits, cfg.top_k)
    if 0 < cfg.top_k < vocab:
        # the k-th largest logit (ties at it are kept): the least of the top k, which need no sorting
        kth = torch.topk(logits, cfg.top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token stays)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


TOP_K_CHUNK = 64  # _top_k_softmax: the chunks whose maxima bound the k-th largest logit from below
TOP_K_MAX_ROWS = 64  # _top_k_softmax loops over rows: more than this go the dense way
TOP_K_MIN_VOCAB = 16384  # below this the dense way is as fast (its fixed cost is some 60 us a row)


def _sparse_top_k(logits: torch.Tensor, cfg: SamplingConfig) -> bool:
    """Whether :func:`warp`'s top-k goes through :func:`_top_k_softmax`: where :func:`kept_rows`
    says so, for a few rows."""
    vocab = logits.shape[-1]  # not inside a compiled region (a fused round): the kept set's size is a host read
    return (kept_rows(vocab, cfg, logits.device) and logits.numel() // vocab <= TOP_K_MAX_ROWS
            and not torch.compiler.is_compiling())


def _top_k_softmax(logits: torch.Tensor, k: int) -> torch.Tensor:
    """softmax over each row's ``k`` largest logits and every tie at the k-th (the rest 0), as
    :func:`warp`'s dense masked softmax gives it, without ``torch.topk`` and a softmax over the
    whole vocabulary. The k-th largest of a row's chunk maxima (chunks of TOP_K_CHUNK logits) is a
    lower bound on its k-th largest logit (those k maxima are k distinct logits), so only the
    chunks whose maximum reaches it can hold a kept logit; among their logits at or above the
    bound, the k-th largest is the threshold. About 4x faster than the dense way over a 49k
    vocabulary on one CPU thread (docs/results/fast.md)."""
    flat = logits.reshape(-1, logits.shape[-1])
    pad = -flat.shape[-1] % TOP_K_CHUNK
    if pad:  # a last, partial chunk filled with -inf
        flat = torch.cat([flat, flat.new_full((flat.shape[0], pad), float("-inf"))], -1)
    out = torch.zeros_like(flat)
    for row, x in zip(out, flat, strict=True):
        ids, probs = _top_k_row(x, k)
        row[ids] = probs
    return out[:, : logits.shape[-1]].reshape(logits.shape)


def _top_k_row(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_top_k_softmax` of one row ``x`` [V] (V a multiple of TOP_K_CHUNK): the kept token ids,
    in increasing order, and their probabilities."""
    ids, vals = _top_k_kept(x, k)
    return torch.from_numpy(ids), torch.from_numpy(vals).softmax(-1)


def _top_k_kept(x: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids (increasing) and logits of one row ``x`` [V] (V a multiple of TOP_K_CHUNK) that top-k
    keeps: its ``k`` largest and every tie at the k-th."""
    # in numpy: the same selections as torch's ops, at a fraction of their dispatch cost (a dozen
    # small ops a row, 4-5 rows a sampled round)
    by_chunk = (x.detach() if x.requires_grad else x).view(-1, TOP_K_CHUNK)
    heads = by_chunk.amax(-1).numpy()  # torch's reduction over rows of 64 is 3x numpy's
    bound = np.partition(heads, heads.size - k)[heads.size - k]  # the k-th largest chunk maximum
    chunks = np.flatnonzero(heads >= bound)
    block = by_chunk.numpy()[chunks].reshape(-1)
    at = np.flatnonzero(block >= bound)
    vals = block[at]
    keep = vals >= np.partition(vals, vals.size - k)[vals.size - k]  # at or above the k-th largest
    ids = chunks[at // TOP_K_CHUNK] * TOP_K_CHUNK + at % TOP_K_CHUNK
    return ids[keep], vals[keep]


@dataclass(frozen=True, eq=False)
class KeptProbs:
    """One warped row kept sparse: the token ids that top-k kept (increasing) and their
    probabilities, of a row of ``vocab`` tokens; every other token has probability 0. ``dense()``
    is the row :func:`warp` gives, bit for bit. The CPU's acceptance rule reads these
    (:func:`specdecpp.core.verify.verify_kept`), so no row of the whole vocabulary is written or
    read in a sampled round (docs/results/fast.md)."""

    ids: np.ndarray  # int64 [n], increasing
    probs: np.ndarray  # float32 [n], summing to 1
    vocab: int

    def dense(self) -> torch.Tensor:
        out = torch.zeros(self.vocab)
        out[torch.from_numpy(self.ids)] = torch.from_numpy(self.probs)
        return out

    def at(self, token: int) -> float:
        """The probability of ``token`` (0 where top-k dropped it), a float32 value as a Python float."""
        j = int(np.searchsorted(self.ids, token))
        return float(self.probs[j]) if j < self.ids.size and self.ids[j] == token else 0.0

    def draw(self, generator: torch.Generator | None) -> int:
        """:func:`sample` of ``dense()``: the same token for the same generator state."""
        return int(self.ids[draw_few(self.probs.tolist(), generator)])


def dense_rows(rows: list) -> list[torch.Tensor]:
    """Rows that may be :class:`KeptProbs`, each as a dense tensor [V] (a tensor row as it is)."""
    return [r.dense() if isinstance(r, KeptProbs) else r for r in rows]


def as_kept(rows: list) -> list[KeptProbs]:
    """Rows that may be dense tensors [V], each as :class:`KeptProbs` (its nonzero entries)."""
    out = []
    for r in rows:
        if not isinstance(r, KeptProbs):
            x = r.detach().float().cpu().numpy()
            ids = np.flatnonzero(x)
            r = KeptProbs(ids, x[ids], x.size)
        out.append(r)
    return out


def kept_rows(width: int, cfg: SamplingConfig, device: torch.device) -> bool:
    """Whether :func:`warp_kept` keeps rows of logits ``width`` wide sparse under ``cfg``: on a CPU
    (the kept set's size is a host read), sampled with top-k and no top-p, over at least
    TOP_K_MIN_VOCAB logits (below, dense rows are about as fast), with at least ``top_k`` whole chunks."""
    return (device.type == "cpu" and not cfg.greedy and cfg.top_p >= 1.0 and cfg.top_k > 0
            and width >= TOP_K_MIN_VOCAB and width // TOP_K_CHUNK >= cfg.top_k)


def warp_kept(logits: torch.Tensor, cfg: SamplingConfig) -> KeptProbs | None:
    """:func:`warp` of one row ``logits`` [V] as :class:`KeptProbs` (``dense()`` is ``warp(logits,
    cfg)`` bit for bit, and its ``draw`` the same token as ``sample``'s), or None where
    :func:`kept_rows` says no. (A reduced draft's -inf logits cost its top-k nothing: gathering its
    scored ones first costs more than it saves.)"""
    vocab = logits.shape[-1]
    if logits.dim() != 1 or not kept_rows(vocab, cfg, logits.device):
        return None
    z = logits if logits.dtype == torch.float32 else logits.float()
    z = z if cfg.temperature == 1.0 else z / cfg.temperature
    if pad := -vocab % TOP_K_CHUNK:  # a last, partial chunk filled with -inf
        z = torch.cat([z, z.new_full((pad,), float("-inf"))])
    ids, vals = _top_k_kept(z, cfg.top_k)
    return KeptProbs(ids, torch.from_numpy(vals).softmax(-1).numpy(), vocab)


def draw_few(probs: list[float], generator: torch.Generator | None) -> int:
    """:func:`sample`'s inverse-CDF draw over a short list of probabilities, in Python floats
    (float64): the same uniform from ``generator``, the same sums, the same clamp, the same search."""
    cum = list(itertools.accumulate(probs))
    total = cum[-1]
    if not (total > 0 and math.isfinite(total) and min(probs) >= 0):
        raise ValueError("sample: every row of probs must be non-negative and finite with a positive sum")
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    return bisect.bisect_right(cum, min(u * total, math.nextafter(total, 0.0)))


SAMPLER = "inverse_cdf"
"""The name of :func:`sample`'s draw. data_gen records it in a dataset's meta: a change of draw changes
every seeded output, so a dataset is not resumed under another (before it was recorded, the draw was
``torch.multinomial``)."""


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, check: bool = True) -> torch.Tensor:
    """Draw one token id per row of ``probs`` ([..., V] -> [...]), row ``i`` with probability
    ``probs[i] / probs.sum()``; ``generator=None`` uses torch's global generator.

    Inverse CDF: one float64 uniform ``u`` per row and the first token whose float64 cumulative
    mass exceeds ``u * total``. A token with zero mass adds nothing to the cumulative sum, so it is
    never drawn, and the draw is clamped below the total, so rounding cannot run past the last
    token with mass. This is exact up to float64 rounding of the cumulative sum, and about 15x
    faster on a CPU over a 49k vocabulary than ``torch.multinomial``, which draws an exponential
    per entry (docs/results/fast.md). The rows must be non-negative, finite, with positive mass.

    ``check=False`` leaves that check to the caller (it is a host read, so on CUDA a synchronisation
    per draw; :func:`draw_token` and :func:`rows_valid` fold it into a read the caller makes anyway):
    the draw is the same for valid rows, and an invalid row still gives an id below V.
    """
    token, ok = _draw(probs, generator, check)
    if not check:
        return token.clamp_max_(probs.shape[-1] - 1)  # for valid rows a no-op
    if not bool(ok.all()):
        raise ValueError(INVALID_PROBS)
    return token


INVALID_PROBS = "sample: every row of probs must be non-negative and finite with a positive sum"


def _draw(probs: torch.Tensor, generator: torch.Generator | None, check: bool = True,
          one_uniform: bool = False, u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sample`'s draw and each row's check (:func:`_rows_ok`, a bool tensor [...], not read
    here; None without ``check``: its operations are kernels on CUDA, for a check nobody reads).
    ``one_uniform``: every row drawn with the same single uniform (:func:`draw_each`); ``u``: the
    float64 uniforms given (:func:`draw_with`), none drawn."""
    if probs.dim() == 0 or probs.shape[-1] == 0:
        raise ValueError(f"sample: probs must be [..., V] with V >= 1, got shape {tuple(probs.shape)}")
    cum = probs.to(torch.float64, copy=True).cumsum_(-1)  # in place: 4-10x faster than cumsum for several rows
    total = cum[..., -1:]
    ok = _rows_ok(total[..., 0], probs) if check else None
    if u is None:
        u = torch.rand((1,) if one_uniform else total.shape, generator=generator, dtype=torch.float64,
                       device=probs.device)
    x = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cum, x, right=True).squeeze(-1), ok


def draw_with(probs: torch.Tensor, u: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sample`'s draw of each row of ``probs`` [..., V] with given float64 uniforms ``u``
    (broadcast to [..., 1]), and each row's check (bool [...]; None with ``check=False``, which
    computes none: a caller that checks the rows later, as a captured round's verdict checks the
    draft's rows, saves its kernels); nothing is read and no generator is touched, so a CUDA graph
    can hold it (a captured round draws its uniforms before the replay,
    specdecpp/decoders/captured.py). An invalid row still gives an id below V."""
    token, ok = _draw(probs, None, check, u=u)
    return token.clamp_max_(probs.shape[-1] - 1), ok


def draw_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """``int(sample(probs, generator))`` for one row [V], its check and the token read together: one
    host read (on CUDA one synchronisation, where ``int(sample(...))`` makes two). The same token and
    the same ValueError."""
    token, ok = _draw(probs, generator)
    value, valid = torch.stack([token.reshape(()), ok.long()]).tolist()
    if not valid:
        raise ValueError(INVALID_PROBS)
    return value


def draw_each(rows: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A token from each row of ``rows`` [R, V], every one drawn with the one float64 uniform that a
    single row's draw (:func:`draw_token`) takes, and each row's check (bool [R]); nothing is read.
    The row a caller then picks gives the token, and leaves the generator in the state, that
    ``draw_token`` of that row alone would (the verification's one-read rule, core/verify.py)."""
    return _draw(rows, generator, one_uniform=True)


def rows_valid(probs: torch.Tensor) -> torch.Tensor:
    """Whether every row of ``probs`` [..., V] is what :func:`sample` draws from (non-negative, finite,
    a positive sum), as a 0-d bool tensor for a caller to read with other values: the check a
    ``sample(..., check=False)`` of these rows left out."""
    return _rows_ok(probs.sum(-1, dtype=torch.float64), probs).all()


def _rows_ok(total: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Whether each row of ``probs`` [..., V] (row totals ``total`` [...]) has a positive, finite total
    and no negative entry (bool [...]). ``0 < total < inf`` is ``total > 0 and isfinite(total)`` (a NaN
    fails both comparisons) in two operations where ``isfinite`` takes four (kernels on CUDA)."""
    return (total > 0) & (total < math.inf) & (probs.amin(-1) >= 0)


def entropy(logits: torch.Tensor, temperature: float = 1.0, support: torch.Tensor | None = None) -> torch.Tensor:
    """Natural-log entropy of softmax(logits / temperature) over the full vocabulary.

    temperature 0 is treated as 1 (raw softmax), as SVIP's authors do under greedy decoding.
    ``support``: the only token ids whose logits may be finite (a reduced output vocabulary,
    :func:`specdecpp.models.reduced_vocab.scored_ids`); the entropy is then computed over those
    logits alone, which is the same number, faster.
    """
    t = temperature if temperature > 0 else 1.0
    logits = scored_logits(logits, support).float()
    return entropy_of_log_probs(torch.log_softmax(logits if t == 1.0 else logits / t, dim=-1))


def scored_logits(logits: torch.Tensor, support: torch.Tensor | None) -> torch.Tensor:
    """The logits [..., V] of the token ids ``support`` (sorted, each below V) only: [..., len(support)];
    ``support`` None: the logits as they are. (A gather: 2x faster than ``index_select`` over the
    last dimension of a 2-D tensor on a CPU.)"""
    if support is None:
        return logits
    if logits.dim() == 1:
        return logits.index_select(0, support)
    return logits.gather(-1, support.expand(*logits.shape[:-1], -1))


LOG_PROB_FLOOR = -80.0
"""Where :func:`entropy_of_log_probs` clamps log-probabilities: exp(-80) = 1.8e-35 is still a normal
float32, so no product is subnormal (subnormal arithmetic is some 10x slower on a CPU) and a -inf
(a token outside a reduced output vocabulary) gives no nan. What the clamp changes, under 1.5e-33
per token, is far below float32's resolution of an entropy."""


def entropy_of_log_probs(logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dimension of log-probabilities ``logp`` (float32; -inf allowed)."""
    c = logp.clamp_min(LOG_PROB_FLOOR)
    return -(c.exp() * c).sum(-1)


def distribution_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Natural-log entropy of a (possibly truncated) probability vector, ignoring zeros."""
    p = probs.float()
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
