"""The verification step of speculative sampling (Leviathan et al.; SpecDec++ Algorithm 1).

Convention, stated once for the whole project: ``p`` is the TARGET's warped distribution and
``q`` the DRAFT's, both produced by :func:`specdecpp.core.sampling.warp` from the same prefix.
Candidate ``y_i`` was sampled from ``q_i``; the target scored the same prefixes in one forward
pass and returned ``p_1 .. p_{K+1}`` (``p_{K+1}`` follows the last candidate).

Accept ``y_i`` with probability ``min(1, p_i(y_i) / q_i(y_i))``. At the first rejection ``i``,
the replacement is drawn from the residual ``Norm[(p_i - q_i)_+]``. If all K are accepted, the
bonus token is drawn from ``p_{K+1}``. The output then has exactly the target's distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .sampling import INVALID_PROBS, KeptProbs, argmax, draw_each, draw_few, draw_token, rows_valid

INVALID_Q = "verify: the draft's rows q must be non-negative and finite with a positive sum"


def acceptance_ratio(p_i: torch.Tensor, q_i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """min(1, p_i(y_i) / q_i(y_i)) for each row i; rows of p_i, q_i are distributions."""
    p_y = p_i.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    q_y = q_i.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return torch.where(q_y > 0, (p_y / q_y.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(p_y))


def residual(p_i: torch.Tensor, q_i: torch.Tensor) -> torch.Tensor:
    """Norm[(p_i - q_i)_+]; falls back to p_i where p_i == q_i up to rounding (no mass left)."""
    r_i = (p_i - q_i).clamp_min(0)
    mass = r_i.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, r_i / mass.clamp_min(1e-30), p_i)


def verify(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
           generator: torch.Generator | None = None, greedy: bool = False,
           bonus: bool = True, drafts_out: list | None = None) -> tuple[int, int | None]:
    """Verify K candidates; return ``(n_accepted, next_token)``.

    draft_tokens: LongTensor [K], the candidates y_1..y_K.
    q: [K, V], q_i for each candidate.   p: [K + 1, V], p_1..p_{K+1}.
    greedy: accept iff y_i == argmax p_i and take argmax p_{n+1}; no randomness is used, ``q`` may
    be None and ``p`` may be the target's raw logits (same argmax).
    K may be 0: then the bonus token from p_1 is the whole round (target-only decoding).
    bonus=False (PEARL): ``p`` is [K, V] and a round with all K accepted returns ``(K, None)``
    (no token is drawn from p_{K+1}; the next draft block continues from there).
    drafts_out: a list to extend with the K candidates' values, read on the host together with the
    verdict (no read of its own), so that a caller needs no read of the drafts to commit them.
    Host reads (on CUDA, synchronisations): one, greedy or sampled with a bonus (the next token is
    drawn before the read, :func:`_verify_in_one_read`); two sampled without a bonus when a row is
    rejected (the verdict, then the residual's draw).
    """
    k = draft_tokens.shape[0]
    rows = k + 1 if bonus else k
    if p.shape[0] != rows or (q is None and not greedy) or (q is not None and q.shape[0] != k) \
            or (k == 0 and not bonus):
        raise ValueError(f"verify: expected q [K, V] and p [{'K+1' if bonus else 'K'}, V] for K={k} "
                         f"(K >= 1 without a bonus), got q {None if q is None else tuple(q.shape)}, p {tuple(p.shape)}")
    if greedy:  # one reduction over every row (the first of ties); the argmaxes and the drafts in one read
        read = torch.cat([argmax(p), draft_tokens.to(p.device)]).tolist()
        top, drafted = read[:rows], read[rows:]
        if drafts_out is not None:
            drafts_out.extend(drafted)
        n = next((i for i in range(k) if top[i] != drafted[i]), k)
        return n, top[n] if n < rows else None
    if k == 0:
        return 0, draw_token(p[0], generator)
    ratio = acceptance_ratio(p[:k], q, draft_tokens)
    u = torch.rand(k, generator=generator, device=ratio.device)
    if bonus:  # every row's replacement drawn before the read: one read for the verdict and the next token
        return _verify_in_one_read(draft_tokens, q, p, ratio, u, generator, drafts_out)
    # accept with probability ratio (u in [0, 1)); read with the check of the draft's rows, which a
    # drafter on CUDA leaves out of its draws (sample(check=False)): one host read for both
    verdict = [u >= ratio, rows_valid(q).reshape(1)]
    if drafts_out is None:
        *rejected, q_ok = torch.cat(verdict).tolist()
    else:  # the drafts in the same read
        read = torch.cat([*(v.long() for v in verdict), draft_tokens.to(ratio.device)]).tolist()
        rejected, q_ok = [bool(r) for r in read[:k]], read[k]
        drafts_out.extend(read[k + 1 :])
    if not q_ok:
        raise ValueError(INVALID_Q)
    if True not in rejected:
        return k, draw_token(p[k], generator) if bonus else None
    n = rejected.index(True)
    return n, draw_token(residual(p[n], q[n]), generator)


def _verify_in_one_read(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, ratio: torch.Tensor,
                        u: torch.Tensor, generator: torch.Generator | None,
                        drafts_out: list | None) -> tuple[int, int]:
    """:func:`verify`'s sampled rule with a bonus token, read once. The token that follows the verdict is
    drawn from the residual of the first rejected row or, all accepted, from p_{K+1}: here every one of
    those K + 1 rows is drawn before the read, all with the one float64 uniform that the chosen row's
    own draw (:func:`~specdecpp.core.sampling.draw_token`) would take, by the same arithmetic row by
    row. So the verdict, the token and the generator's state are :func:`verify`'s two-read way's
    (tests/core/test_sampling.py), and on CUDA a round synchronises once instead of twice."""
    k = draft_tokens.shape[0]
    rows = torch.cat([residual(p[:k], q), p[k:]])  # row i < K: the residual of a rejection at i; row K: p_{K+1}
    tokens, ok = draw_each(rows, generator)
    read = torch.cat([(u >= ratio).long(), rows_valid(q).long().reshape(1), ok.long(), tokens,
                      draft_tokens.to(rows.device)]).tolist()
    rejected, q_ok = read[:k], read[k]
    if not q_ok:
        raise ValueError(INVALID_Q)
    if drafts_out is not None:
        drafts_out.extend(read[3 * k + 3 :])
    n = next((i for i, r in enumerate(rejected) if r), k)
    if not read[k + 1 + n]:
        raise ValueError(INVALID_PROBS)
    return n, read[2 * k + 2 + n]


def _check_rows(name: str, k: int, q_rows: int, p_rows: int, bonus: bool) -> None:
    """The row counts a row-at-a-time rule needs: K q rows and K + 1 p rows (K without a bonus, K >= 1)."""
    if q_rows != k or p_rows != k + bonus or (k == 0 and not bonus):
        raise ValueError(f"{name}: expected {k} q rows and {'K+1' if bonus else 'K'} p rows for K={k} "
                         f"(K >= 1 without a bonus), got {q_rows} and {p_rows}")


def verify_rows(draft_tokens: torch.Tensor, q: Sequence[torch.Tensor], p_row: Callable[[int], torch.Tensor],
                p_rows: int, generator: torch.Generator | None = None, bonus: bool = True) -> tuple[int, int | None]:
    """:func:`verify`'s sampled rule, computing only the target rows it reads: ``p_row(i)`` gives
    p_{i+1} [V], called for rows 0..n (the first rejection n) or, when all K are accepted, for
    every row and the bonus row K. The same uniforms are drawn in the same order as in
    :func:`verify` and every row's arithmetic is the same, so for the same generator state both
    return the same verdict; a target row after the first rejection is never warped. ``q``: the K
    rows q_i [V]; ``p_rows``: how many target rows there are (K + 1, or K without a bonus). For a
    CPU, where reading each row's verdict costs no device sync (on a GPU :func:`verify` reads them
    all at once)."""
    k = draft_tokens.shape[0]
    _check_rows("verify_rows", k, len(q), p_rows, bonus)
    if k == 0:
        return 0, draw_token(p_row(0), generator)
    u = torch.rand(k, generator=generator, device=draft_tokens.device)
    for i in range(k):
        p_i = p_row(i)
        if bool(u[i] >= acceptance_ratio(p_i, q[i], draft_tokens[i])):  # rejected: the residual's draw
            return i, draw_token(residual(p_i, q[i]), generator)
    return k, draw_token(p_row(k), generator) if bonus else None


def verify_kept(draft_tokens: Sequence[int], q: Sequence[KeptProbs], p_row: Callable[[int], KeptProbs],
                p_rows: int, generator: torch.Generator | None = None, bonus: bool = True) -> tuple[int, int | None]:
    """:func:`verify_rows` over rows kept sparse (:class:`~specdecpp.core.sampling.KeptProbs`, a CPU's
    top-k rows): ``p_i(y)`` and ``q_i(y)`` are looked up, the residual ``(p_i - q_i)+`` is formed over
    the union of the two rows' kept tokens (outside it both are 0) and drawn from there, so no row
    of the whole vocabulary is written or read. The same uniforms are drawn in the same order, the
    ratio is the same float32 quotient and the residual's terms the same float32 differences as
    :func:`verify`'s, so for the same generator state the verdict is the same; only the residual's
    normaliser is summed over fewer terms, which may move its last bit (and a draw that lands
    within that rounding of a boundary). ``draft_tokens``: the K candidates as ints."""
    k = len(draft_tokens)
    _check_rows("verify_kept", k, len(q), p_rows, bonus)
    if k == 0:
        return 0, p_row(0).draw(generator)
    u = torch.rand(k, generator=generator).tolist()  # float32 draws, exact as Python floats
    for i, y in enumerate(draft_tokens):
        p_i, q_i = p_row(i), q[i]
        q_y = q_i.at(y)
        ratio = min(1.0, float(np.float32(p_i.at(y)) / np.float32(q_y))) if q_y > 0 else 1.0
        if u[i] >= ratio:  # rejected: the residual's draw
            return i, _residual_draw(p_i, q_i, generator)
    return k, p_row(k).draw(generator) if bonus else None


def _residual_draw(p: KeptProbs, q: KeptProbs, generator: torch.Generator | None) -> int:
    """``sample(residual(p.dense(), q.dense()), generator)`` over the union of the kept tokens."""
    ids = np.union1d(p.ids, q.ids)
    p_u = np.zeros(ids.size, np.float32)
    p_u[np.searchsorted(ids, p.ids)] = p.probs
    q_u = np.zeros(ids.size, np.float32)
    q_u[np.searchsorted(ids, q.ids)] = q.probs
    r = np.maximum(p_u - q_u, np.float32(0))
    mass = r.sum(dtype=np.float32)
    r = r / max(mass, np.float32(1e-30)) if mass > 1e-12 else p_u
    return int(ids[draw_few(r.tolist(), generator)])
