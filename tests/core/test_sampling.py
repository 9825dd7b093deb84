import math

import numpy as np
import pytest
import torch

from specdecpp.core.sampling import (
    SamplingConfig,
    argmax,
    as_kept,
    entropy,
    sample,
    warp,
    warp_kept,
)
from specdecpp.core.verify import acceptance_ratio, residual, verify, verify_kept, verify_rows
from tests.helpers.stats import chi_square_pvalue


def _logits(v=10, seed=0):
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_one_hot_argmax():
    logits = _logits()
    probs = warp(logits, SamplingConfig(temperature=0))
    assert probs.sum() == 1 and probs[logits.argmax()] == 1


def test_temperature_matches_scaled_softmax():
    logits = _logits()
    np.testing.assert_allclose(warp(logits, SamplingConfig(temperature=0.7)).numpy(),
                               torch.softmax(logits / 0.7, -1).numpy(), rtol=1e-6)


def test_top_k_keeps_the_k_largest_renormalised():
    logits = _logits(12)
    probs = warp(logits, SamplingConfig(top_k=4))
    keep = set(torch.topk(logits, 4).indices.tolist())
    assert {i for i, p in enumerate(probs.tolist()) if p > 0} == keep
    expected = torch.softmax(logits[sorted(keep)], -1)
    np.testing.assert_allclose(probs[sorted(keep)].numpy(), expected.numpy(), rtol=1e-6)


def test_ties_greedy_takes_the_first_and_top_k_keeps_every_tie_at_the_kth():
    logits = torch.tensor([[1.0, 5.0, 0.0, 5.0, 2.0, 2.0, 2.0, -1.0]]).repeat(2, 1).bfloat16()
    assert warp(logits, SamplingConfig(0.0)).argmax(-1).tolist() == [1, 1]
    kept = warp(logits, SamplingConfig(top_k=3)) > 0  # 5, 5 and the three tied 2s
    assert kept.nonzero()[:, 1].tolist() == [1, 3, 4, 5, 6] * 2


def test_top_k_larger_than_vocab_means_no_truncation():
    logits = _logits(6)
    np.testing.assert_allclose(warp(logits, SamplingConfig(top_k=50)).numpy(),
                               torch.softmax(logits, -1).numpy(), rtol=1e-6)


def test_top_p_keeps_the_smallest_nucleus():
    logits = _logits(12, seed=3)
    full = torch.softmax(logits, -1).numpy()
    order = np.argsort(-full)
    # independent: smallest prefix of the sorted tokens whose mass reaches top_p
    for top_p in (0.3, 0.6, 0.9, 0.999):
        n_keep = int(np.searchsorted(np.cumsum(full[order]), top_p) + 1)
        kept = set(order[:n_keep].tolist())
        probs = warp(logits, SamplingConfig(top_p=top_p)).numpy()
        assert {i for i, p in enumerate(probs) if p > 0} == kept
        np.testing.assert_allclose(probs[list(kept)], full[list(kept)] / full[list(kept)].sum(), rtol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(temperature=float("nan"))])
def test_sampling_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_entropy_is_natural_log_of_full_softmax():
    logits = _logits()
    p = torch.softmax(logits, -1).numpy()
    assert math.isclose(float(entropy(logits)), float(-(p * np.log(p)).sum()), rel_tol=1e-5)
    assert math.isclose(float(entropy(logits, 0.0)), float(entropy(logits, 1.0)))  # greedy: raw softmax


def test_acceptance_ratio_and_residual():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.25, 0.6, 0.15]])
    assert acceptance_ratio(p, q, torch.tensor([0])).item() == 1.0
    assert acceptance_ratio(p, q, torch.tensor([1])).item() == pytest.approx(0.5)
    np.testing.assert_allclose(residual(p, q).numpy(), [[0.25 / 0.3, 0.0, 0.05 / 0.3]], rtol=1e-6)


def _random_dists(k, v, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, v, generator=g) * 1.5, -1)
    return p, q


@pytest.mark.parametrize("rule", ["dense", "kept"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_verify_first_token_has_target_distribution(k, rule):
    """Draft y ~ q, verify: the first emitted token is distributed as p_1, whatever q is; by the
    dense rule and by the CPU's rule over rows kept sparse (q and p with zeros, as top-k leaves them)."""
    p, q = _random_dists(k, 5, seed=k)
    if rule == "kept":  # top-k-like rows: a token dropped from q, another from p_1
        q[:, 4], p[0, 1] = 0, 0
        q, p = q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)
    q_kept, p_kept = as_kept(list(q)), as_kept(list(p))
    g = torch.Generator().manual_seed(100 + k)
    firsts, drafted = [], []
    for _ in range(6000):
        y = sample(q, g)
        if rule == "dense":
            n_acc, nxt = verify(y, q, p, g)
        else:
            n_acc, nxt = verify_kept(y.tolist(), q_kept, lambda i: p_kept[i], k + 1, g)
        firsts.append(int(y[0]) if n_acc >= 1 else nxt)
        drafted.append(int(y[0]))
    expected = dict(enumerate(p[0].tolist()))
    assert chi_square_pvalue(firsts, expected) > 1e-4
    # negative control: the same test rejects the draft's own samples
    assert chi_square_pvalue(drafted, expected) < 1e-6


def test_verify_greedy_is_argmax_agreement():
    p = torch.eye(4)[[2, 1, 3]]           # target argmax: 2, 1, then 3
    q = torch.full((2, 4), 0.25)
    assert verify(torch.tensor([2, 1]), q, p, greedy=True) == (2, 3)
    assert verify(torch.tensor([2, 0]), q, p, greedy=True) == (1, 1)
    assert verify(torch.tensor([0, 1]), q, p, greedy=True) == (0, 2)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_verify_hands_out_the_drafts_it_read_with_its_verdict(greedy):
    """verify(..., drafts_out=L) extends L with the candidates' values (read with the verdict, so that a
    commit need not read them) and changes nothing else: the same verdict, the generator left in the same
    state; K = 0 adds nothing."""
    for k in (0, 1, 3):
        for seed in range(40):
            p, q = _random_dists(k, 6, seed)
            y = torch.randint(0, 6, (k,), generator=torch.Generator().manual_seed(seed))
            gens = [torch.Generator().manual_seed(seed) for _ in range(2)]
            out: list = []
            got = verify(y, None if greedy else q, p, gens[0], greedy=greedy, drafts_out=out)
            assert got == verify(y, None if greedy else q, p, gens[1], greedy=greedy)
            assert out == y.tolist() and all(isinstance(t, int) for t in out)
            assert torch.equal(gens[0].get_state(), gens[1].get_state())


def test_verify_rejects_bad_shapes():
    p, q = _random_dists(2, 5, 0)
    with pytest.raises(ValueError, match="K\\+1"):
        verify(torch.tensor([1, 2]), q, p[:2])


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sample_draws_each_row_from_its_distribution(device, dtype):
    """sample against known rows: zero entries (at both ends and inside) are never drawn, an unnormalised
    row is drawn from its normalisation, a near-one-hot row keeps its small mass; [..., V] -> [...]."""
    rows = torch.tensor([[0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0, 0.0],
                         [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],        # one-hot on the last token
                         [2.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0],        # sums to 4
                         [0.0, 0.97, 0.0, 0.0, 0.01, 0.0, 0.02, 0.0]],   # near one-hot, zeros after the mass
                        dtype=dtype, device=device)
    n = 6000
    g = torch.Generator(device).manual_seed(0)
    draws = sample(rows.unsqueeze(1).expand(4, n, 8), g)
    assert draws.shape == (4, n) and draws.dtype == torch.long and draws.device.type == device
    for row, got in zip(rows.double().cpu(), draws.cpu(), strict=True):
        probs = row / row.sum()
        assert set(got.tolist()) <= set(probs.nonzero().squeeze(-1).tolist())  # zero mass: never drawn
        if (probs > 0).sum() > 1:  # (the one-hot row: the support check above is the whole test)
            assert chi_square_pvalue(got.tolist(), dict(enumerate(probs.tolist()))) > 1e-4
    # negative control: the same test rejects another row's draws
    assert chi_square_pvalue(draws[3].tolist(), dict(enumerate((rows[0].double() / rows[0].sum()).tolist()))) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_sample_same_seed_same_output(device):
    probs = warp(torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)).to(device), SamplingConfig(1.0, 50))
    draw = [sample(probs, torch.Generator(device).manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(draw[0], draw[1]) and draw[0].shape == (3,)
    many = [sample(probs.expand(64, 3, 5000), torch.Generator(device).manual_seed(s)) for s in (7, 8)]
    assert not torch.equal(many[0], many[1])
    torch.manual_seed(3)  # generator=None: torch's global generator
    first = sample(probs.expand(64, 3, 5000)) if device == "cpu" else None
    torch.manual_seed(3)
    assert device != "cpu" or torch.equal(first, sample(probs.expand(64, 3, 5000)))


def test_sample_never_runs_past_the_last_token_with_mass(monkeypatch):
    """The extreme uniforms: u = 0 gives the first token with mass, the largest float64 below 1 the last
    (never a zero-mass token after it). With a normal total, u * total stays below it; with a subnormal
    one (spacing 2**-1074) it rounds up to the total, and only the clamp keeps the draw on token 3."""
    tiny = 2.0 ** -1074
    for probs in (torch.tensor([[0.0, 0.3, 0.0, 0.7 + 1e-7, 0.0, 0.0]]),
                  torch.tensor([[0.0, 2 * tiny, 0.0, tiny, 0.0, 0.0]], dtype=torch.float64)):
        for u, token in ((0.0, 1), (1.0 - 2.0 ** -53, 3)):
            monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(a[0], u, dtype=torch.float64))
            assert sample(probs).tolist() == [token]


@pytest.mark.parametrize("probs", [torch.tensor([0.5, -0.1, 0.6]), torch.tensor([0.5, float("nan"), 0.5]),
                                   torch.tensor([0.0, 0.0]), torch.tensor([1.0, float("inf")])])
def test_sample_rejects_rows_that_are_not_distributions(probs):
    with pytest.raises(ValueError, match="sample: every row of probs must be non-negative and finite"):
        sample(probs)
    with pytest.raises(ValueError, match=r"sample: probs must be \[\.\.\., V\] with V >= 1"):
        sample(torch.zeros(3, 0))


@pytest.mark.parametrize("probs", [torch.tensor([0.5, -0.1, 0.6]), torch.tensor([0.5, float("nan"), 0.5]),
                                   torch.tensor([0.0, 0.0]), torch.tensor([1.0, float("inf")])])
def test_the_check_can_be_read_later_and_the_draw_stays_in_range(probs):
    """sample(check=False) leaves the check to a later read: for a row that is no distribution it still
    gives an id below V; draw_token reads the token and the check together and raises as sample does;
    rows_valid is that check as a tensor."""
    from specdecpp.core.sampling import draw_token, rows_valid

    assert 0 <= int(sample(probs, torch.Generator().manual_seed(0), check=False)) < probs.shape[-1]
    with pytest.raises(ValueError, match="sample: every row of probs must be non-negative and finite"):
        draw_token(probs, torch.Generator().manual_seed(0))
    uniform = torch.full_like(probs, 1 / probs.shape[-1])
    assert bool(rows_valid(uniform)) and not bool(rows_valid(probs)) and not bool(rows_valid(torch.stack([uniform,
                                                                                                          probs])))


def test_verify_checks_the_draft_rows_a_drafter_left_unchecked():
    """Off a CPU the drafter draws without checking its row (one host read per round instead of one per
    draft); verify's one read of the verdict then checks the rows q, and a row that is no
    distribution is an error, not a verdict."""
    p = torch.softmax(torch.randn(3, 6, generator=torch.Generator().manual_seed(0)), -1)
    q = p[:2].clone()
    q[1, 2] = float("nan")
    with pytest.raises(ValueError, match="verify: the draft's rows q must be non-negative and finite"):
        verify(torch.tensor([1, 4]), q, p, torch.Generator().manual_seed(0))


def test_unchecked_draws_and_draw_token_equal_sample():
    """For rows that are distributions, sample(check=False) and draw_token draw what sample draws, from
    the same generator state, and leave the generator where sample leaves it."""
    from specdecpp.core.sampling import draw_token, rows_valid

    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        probs = torch.rand(2, 37, generator=gen) ** 4
        probs[:, torch.randint(0, 37, (5,), generator=gen)] = 0.0
        states = [torch.Generator().manual_seed(7) for _ in range(3)]
        ref = sample(probs, states[0])
        assert torch.equal(sample(probs, states[1], check=False), ref) and bool(rows_valid(probs))
        assert draw_token(probs[0], states[2]) == int(sample(probs[0], torch.Generator().manual_seed(7)))
        assert torch.equal(states[0].get_state(), states[1].get_state())


def test_draw_with_given_uniforms_draws_what_sample_draws_checked_or_not():
    """draw_with(probs, u) with the uniform sample would take from a generator gives sample's token,
    with check=False too, which hands back no check; an invalid row is flagged only when checked, and
    its token stays below V either way (a captured candidate's draw: its rows are checked later)."""
    from specdecpp.core.sampling import draw_with

    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        probs = torch.rand(2, 41, generator=gen) ** 3
        probs[:, torch.randint(0, 41, (6,), generator=gen)] = 0.0
        u = torch.rand(2, 1, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        ref = sample(probs, torch.Generator().manual_seed(9))
        (checked, ok), (unchecked, none) = draw_with(probs, u), draw_with(probs, u, check=False)
        assert torch.equal(checked, ref) and torch.equal(unchecked, ref) and bool(ok.all()) and none is None
    bad = torch.full((1, 41), float("nan"))
    token, ok = draw_with(bad, torch.full((1, 1), 0.5, dtype=torch.float64))
    assert not bool(ok.any()) and 0 <= int(token[0]) < 41
    assert 0 <= int(draw_with(bad, torch.full((1, 1), 0.5, dtype=torch.float64), check=False)[0][0]) < 41


def test_an_unchecked_draw_computes_no_check():
    """sample(check=False) dispatches none of the check's operations (on CUDA each is a kernel launched
    for a value nobody reads): its operations are sample's less exactly those of rows' validity."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    probs = torch.rand(3, 50, generator=torch.Generator().manual_seed(1))
    counted = []
    for check in (True, False):
        with Ops() as ops:
            sample(probs, torch.Generator().manual_seed(2), check=check)
        counted.append(ops.names)
    checked, unchecked = counted
    assert checked["bitwise_and"] == 2 and checked["_local_scalar_dense"] == 1  # the check's ands, and its read
    assert unchecked["bitwise_and"] == 0 and unchecked["_local_scalar_dense"] == 0
    assert sum(unchecked.values()) <= sum(checked.values()) - 7  # the check's 7 and its read, less the clamp


@pytest.mark.parametrize("vocab", [49152, 20000])  # whole chunks; a last partial one
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cpu_top_k_way_equals_the_dense_way(monkeypatch, vocab, temperature):
    """warp's CPU top-k (chunk maxima bound the k-th largest logit) keeps exactly the dense way's
    tokens, ties at the k-th included, with the same probabilities; it is the way taken."""
    import specdecpp.core.sampling as sampling

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 2, vocab, generator=gen)  # below 8 (the planted values)
    logits[0, 0, :60] = 9.0  # 60 ties above the 50th
    logits[0, 1, 100:149] = 9.0  # 49 above and a tie of 3 at the 50th
    logits[0, 1, 5000:5003] = 8.0
    logits[1, 0, 30:] = float("-inf")  # fewer finite logits than k: all 30 kept
    logits[2] = logits[2].bfloat16().float()  # bf16's coarse values: many ties
    cfg = SamplingConfig(temperature=temperature, top_k=50)
    taken = []
    monkeypatch.setattr(sampling, "_top_k_softmax", lambda x, k, f=sampling._top_k_softmax: taken.append(k) or f(x, k))
    fast = warp(logits, cfg)
    assert taken == [50]
    monkeypatch.setattr(sampling, "TOP_K_MAX_ROWS", 0)  # the dense way
    dense = warp(logits, cfg)
    assert taken == [50]
    assert torch.equal(fast > 0, dense > 0)
    torch.testing.assert_close(fast, dense, atol=1e-7, rtol=1e-5)
    assert (fast[0, 0] > 0).sum() == 60 and (fast[0, 1] > 0).sum() == 52 and (fast[1, 0] > 0).sum() == 30
    assert (fast[2] > 0).sum(-1).min() >= 50


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0, 50), SamplingConfig(0.7, 5), SamplingConfig(1.0, 0),
                                 SamplingConfig(0.8, 50, 0.9), SamplingConfig(0.0, 50)],
                         ids=["top50", "T0.7-top5", "no-top-k", "top-p", "greedy"])
def test_warp_kept_is_warp_and_its_draw_is_sample_s(cfg):
    """A row kept sparse (top-k on a CPU over a 49k vocabulary): dense() is warp's row bit for bit,
    and its draw gives the token sample(warp) gives from the same generator state, leaving the
    generator where sample leaves it; where top-k does not apply (no top-k, top-p, greedy) there
    is no kept row."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(200, 49152, generator=gen) * 3
    rows[::3, :30000] = float("-inf")  # a reduced draft's -inf logits
    rows[1::3] = rows[1::3].bfloat16().float()  # coarse values: ties at the k-th
    applies = cfg.top_k > 0 and cfg.top_p == 1.0 and not cfg.greedy
    for row in rows:
        kept = warp_kept(row, cfg)
        assert (kept is not None) == applies
        if not applies:
            continue
        a, b = torch.Generator().manual_seed(int(row[-1].abs() * 1e4)), torch.Generator()
        b.set_state(a.get_state())
        q_ref = warp(row, cfg)
        assert torch.equal(kept.dense(), q_ref) and kept.draw(a) == int(sample(q_ref, b))
        assert torch.equal(a.get_state(), b.get_state())
        y = int(sample(q_ref, b))
        assert kept.at(y) == float(q_ref[y]) > 0 and kept.at(int(argmax(-row))) == 0.0
    if applies:
        fewer = torch.full((49152,), float("-inf"))
        fewer[7] = 0.0  # one finite logit: the only token there is
        assert warp_kept(fewer, cfg).draw(None) == 7
        assert warp_kept(torch.randn(1000), cfg) is None  # a small vocabulary: dense rows
        odd = torch.randn(20000, generator=gen)  # a last, partial chunk
        assert torch.equal(warp_kept(odd, cfg).dense(), warp(odd, cfg))
    import specdecpp.core.sampling as sampling

    with pytest.raises(ValueError, match="non-negative and finite"):
        sampling.draw_few([0.5, float("nan")], None)


def test_verify_kept_gives_verify_s_verdict_over_rows_kept_sparse():
    """The CPU rule over rows kept sparse returns what verify returns over the same rows dense, for
    the same generator state (rejections, residual draws over the union of the two supports, bonus
    tokens, rounds without a bonus), asks for target rows only up to the first rejection, and leaves
    the generator where verify leaves it."""
    gen = torch.Generator().manual_seed(12)
    outcomes = set()
    for trial in range(600):
        bonus = trial % 5 != 0
        k = trial % 4 + (0 if bonus else 1)
        p, q = _random_dists(k, 12, seed=trial)
        p, q = p * (torch.rand(p.shape, generator=gen) > 0.4), q * (torch.rand(q.shape, generator=gen) > 0.4)
        q[:, 0] += 1e-3  # no row left empty
        p[:, 0] += 1e-3
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
        p = p if bonus else p[:k]
        y = sample(q, gen) if k else torch.zeros(0, dtype=torch.long)
        a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        p_kept, asked = as_kept(list(p)), []
        got = verify_kept(y.tolist(), as_kept(list(q)),
                          lambda i, asked=asked, p_kept=p_kept: asked.append(i) or p_kept[i], p.shape[0], a, bonus)
        assert got == verify(y, q, p, b, bonus=bonus)
        n, token = got
        assert asked == list(range(min(n + 1, p.shape[0]))) and torch.equal(a.get_state(), b.get_state())
        outcomes.add((n == k, token is None))
    assert outcomes == {(True, False), (False, False), (True, True)}
    with pytest.raises(ValueError, match="K\\+1"):
        verify_kept([1, 2], as_kept(list(q[:1])) * 2, lambda i: p_kept[i], 2)


@pytest.mark.parametrize("bonus", [True, False])
def test_verify_rows_gives_verify_s_verdict_and_warps_no_row_after_the_first_rejection(bonus):
    """The CPU rule reads target rows one at a time: for the same generator state it returns what
    verify returns, and asks only for rows up to the first rejection (all K and the bonus row when
    every candidate is accepted)."""
    gen = torch.Generator().manual_seed(11)
    verdicts = set()
    for trial in range(400):
        k = trial % 4 + (0 if bonus else 1)
        p, q = _random_dists(k, 6, seed=trial)
        p = p if bonus else p[:k]
        y = sample(q, gen) if k else torch.zeros(0, dtype=torch.long)
        a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        asked = []
        got = verify_rows(y, list(q), lambda i, asked=asked, p=p: asked.append(i) or p[i], p.shape[0], a, bonus)
        assert got == verify(y, q, p, b, bonus=bonus)
        n, token = got
        assert asked == list(range(min(n + 1, p.shape[0]))) and torch.equal(a.get_state(), b.get_state())
        verdicts.add((n == k, token is None))
    assert verdicts == ({(True, False), (False, False)} if bonus else {(True, True), (False, False)})
    p, q = _random_dists(2, 6, seed=0)
    with pytest.raises(ValueError, match="K\\+1"):
        verify_rows(torch.tensor([1, 2]), list(q), lambda i: p[i], 2)


def test_verify_reads_once_and_draws_what_the_row_by_row_rule_draws():
    """With a bonus token, verify draws every candidate replacement row (each rejection's residual and
    p_{K+1}) before its one read, with the single uniform the chosen row's own draw takes: over a large
    vocabulary, from bf16 logits, it returns the row-by-row rule's verdict and token and leaves the
    generator in the same state; a chosen row that is no distribution is still sample's ValueError."""
    from specdecpp.core.sampling import INVALID_PROBS, warp

    cfg = SamplingConfig(temperature=1.0, top_k=50)
    gen = torch.Generator().manual_seed(21)
    outcomes = set()
    for trial in range(120):
        k = trial % 4 + 1
        logits = torch.randn(2 * k + 1, 4096, generator=gen).to(torch.bfloat16) * 3
        q, p = warp(logits[:k], cfg), warp(logits[k:], cfg)
        if trial % 3 == 0:  # a draft close to the target: more acceptances, the bonus row drawn
            q = warp(logits[k : 2 * k], cfg)
        y = sample(q, gen)
        a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        got = verify(y, q, p, a)
        assert got == verify_rows(y, list(q), lambda i, p=p: p[i], k + 1, b)
        assert torch.equal(a.get_state(), b.get_state())
        outcomes.add(got[0] == k)
    assert outcomes == {True, False}
    p, q = _random_dists(2, 6, seed=3)
    p[2] = float("nan")  # the bonus row, chosen when both candidates are accepted (q = p: ratio 1)
    with pytest.raises(ValueError, match=INVALID_PROBS.split(":")[0]):
        verify(torch.tensor([0, 1]), p[:2].clone(), p, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("shape", [(49152,), (4, 49152), (2, 3, 100), (7,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_is_the_first_of_ties_as_max_indices(shape, dtype):
    """The greedy argmax (numpy's for float32/64 on a CPU) gives max(-1).indices: the same index,
    the first of ties, with -inf logits (a reduced draft's) and bf16's coarse values."""
    gen = torch.Generator().manual_seed(len(shape))
    for _ in range(30):
        x = (torch.randn(*shape, generator=gen) * 3).bfloat16().to(dtype)  # coarse values: ties
        x.view(-1)[::7] = float("-inf")
        got, want = argmax(x), x.max(-1).indices
        assert got.shape == want.shape and got.dtype == want.dtype == torch.long and torch.equal(got, want)
    tied = torch.zeros(shape, dtype=dtype)
    assert (argmax(tied) == 0).all()
