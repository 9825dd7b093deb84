"""PEARL is lossless and deterministic whatever the threads' timing: greedy equality, the target's
exact distribution (EOS and the length limit included), delayed threads, stats and caches."""

import itertools
import random
import threading
import time

import pytest
import torch

from specdecpp import SVIP, AcceptanceHead, NextTokenHead, PEARLDecoder, SamplingConfig
from specdecpp.core.verify import verify
from tests.helpers.tiny import noisy_copy, tiny_lm


@pytest.fixture(scope="module")
def pair32():
    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    return noisy_copy(target, 0.15, seed=6), target


@pytest.fixture(scope="module")
def pair6():
    target = tiny_lm(5, 16, 2, seed=21, scale=0.8, heads=2)
    return noisy_copy(target, 0.25, seed=22), target


PROMPTS = [[1, 2, 3], [7], [4, 4, 9, 10, 11, 3, 5]]


def identity_holds(s) -> bool:
    """PEARL's form of N_draft + N_target = N + N_discarded: a fully accepted round draws no token
    from the target (no bonus), so those rounds are added on the right."""
    return s.n_draft_calls + s.n_target_calls == s.n_generated + s.n_discarded + s.n_no_target_token


@pytest.mark.parametrize("gamma,policy", [(1, None), (3, None), (5, None), (4, "svip")])
def test_greedy_equals_target_greedy(pair32, gamma, policy):
    draft, target = pair32
    stop = SVIP(threshold=0.35, max_candidates=6) if policy else None
    decoder = PEARLDecoder(draft, target, gamma, SamplingConfig(temperature=0), policy=stop)
    post = 0
    for prompt, n in itertools.product(PROMPTS, (1, 5, 23)):
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=n, do_sample=False)
        out = decoder.generate(ids, max_new_tokens=n)
        assert out.tokens.tolist() == ref.tolist(), (prompt, n)
        s = out.stats
        assert s.n_generated == n and identity_holds(s)
        post += s.n_post_verify_rounds
    if gamma > 1:
        assert post > 0  # post-verify rounds (pending drafts) were exercised


def test_gamma_auto_is_theorem_1(pair32):
    decoder = PEARLDecoder(*pair32, "auto", SamplingConfig(temperature=0))
    out = decoder.generate(torch.tensor([[1, 2]]), 6)
    c = decoder.costs
    assert decoder.gamma == out.stats.gamma == max(1, min(16, round(c["t_target_s"] / c["t_draft_s"])))
    assert decoder.settings()["gamma"] == "auto"


@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_stops_at_eos_like_the_target(pair32, gamma):
    draft, target = pair32
    decoder = PEARLDecoder(draft, target, gamma, SamplingConfig(temperature=0))
    for prompt, at in itertools.product(PROMPTS, (2, 7)):
        ids = torch.tensor([prompt])
        free = target.generate(ids, max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
        eos = free[at]  # emitted mid-way, often inside an accepted draft block
        ref = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        out = decoder.generate(ids, max_new_tokens=20, eos_token_id=eos)
        assert out.tokens.tolist() == ref.tolist()
        assert out.stats.n_generated == free.index(eos) + 1 and identity_holds(out.stats)


def _delay(model, rng: random.Random, max_s: float):
    return model.register_forward_pre_hook(lambda *a: time.sleep(rng.random() * max_s))


def test_same_seed_same_output_whatever_the_threads_timing(pair32):
    """Random sleeps before each draft or target forward change which side finishes first; the
    output, the rounds and the counts must not change."""
    draft, target = pair32
    decoder = PEARLDecoder(draft, target, 3, SamplingConfig(temperature=1.0, top_k=10))

    def run(seed):
        out = decoder.generate(torch.tensor([[1, 2]]), 30, generator=torch.Generator().manual_seed(seed))
        s = out.stats
        return out.tokens.tolist(), s.accept_lengths, s.candidate_lengths, s.n_draft_calls, s.n_discarded

    plain = [run(s) for s in (0, 1)]
    assert plain[0] != plain[1]
    rng = random.Random(0)
    for who in ("draft", "target", "both"):
        handles = [_delay(m, rng, 0.004) for name, m in (("draft", draft), ("target", target))
                   if who in (name, "both")]
        try:
            assert [run(s) for s in (0, 1)] == plain, who
        finally:
            for h in handles:
                h.remove()


def test_models_run_concurrently_and_the_overlap_is_measured(pair32):
    """The draft runs on another thread than the target, and with both sides slowed to 10 ms a
    forward the measured overlap covers most of the shorter side."""
    draft, target = pair32
    threads = {"draft": set(), "target": set()}

    def slow(name):
        def hook(*args):
            threads[name].add(threading.get_ident())
            time.sleep(0.01)
        return hook

    hooks = [m.register_forward_pre_hook(slow(name)) for name, m in (("draft", draft), ("target", target))]
    try:
        out = PEARLDecoder(draft, target, 2, SamplingConfig(temperature=0)).generate(torch.tensor([[1, 2]]), 12)
    finally:
        for h in hooks:
            h.remove()
    s = out.stats
    assert threads["draft"] and threads["target"] == {threading.get_ident()}
    assert not threads["draft"] & threads["target"]
    assert 0 < s.overlap_time_s <= min(s.draft_time_s, s.target_time_s) + 1e-6
    assert s.overlap_share > 0.5
    assert s.wall_time_s >= s.draft_time_s + s.target_time_s - s.overlap_time_s - 1e-3


def test_stats_are_consistent(pair32):
    draft, target = pair32
    out = PEARLDecoder(draft, target, 3, SamplingConfig(temperature=1.0)).generate(
        torch.tensor([[2, 5]]), 50, generator=torch.Generator().manual_seed(0))
    s = out.stats
    assert s.n_generated == 50 == out.tokens.shape[1] - 2
    assert identity_holds(s)
    rounds = len(s.accept_lengths)
    assert s.n_target_calls == rounds == s.n_pre_verify_rounds + s.n_post_verify_rounds
    assert sum(s.accept_lengths) + (rounds - s.n_no_target_token) == s.n_generated  # no EOS: nothing cut
    assert all(a <= c <= 3 for a, c in zip(s.accept_lengths, s.candidate_lengths, strict=True))
    assert s.n_post_verify_rounds > 0 and s.n_no_target_token > 0


def test_verify_without_bonus():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert verify(torch.tensor([1, 2]), q, p, bonus=False) == (2, None)
    assert verify(torch.tensor([1, 2]), None, p, greedy=True, bonus=False) == (2, None)
    assert verify(torch.tensor([1, 0]), None, p, greedy=True, bonus=False) == (1, 2)
    n, token = verify(torch.tensor([1, 1]), torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]), p, bonus=False)
    assert (n, token) == (1, 2)  # p(1) = 0 at the second row: rejected, residual = p
    with pytest.raises(ValueError, match="K >= 1"):
        verify(torch.tensor([], dtype=torch.long), q[:0], p[:0], bonus=False)


@pytest.mark.parametrize("gamma", [0, -1, 1.5, True, "theorem"])
def test_bad_gamma_is_refused(pair32, gamma):
    with pytest.raises(ValueError, match="gamma"):
        PEARLDecoder(*pair32, gamma)


# -- infer: method=pearl in the harness, its rows and the report ----------------------------------
def test_infer_method_pearl_rows_and_report(tiny_pair, tmp_path):
    import infer.app as app
    from infer.report import build_report
    from infer.results import read_rows
    from tests.helpers.infer import make_cfg

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n'
                       '{"id": "math", "prompt": "What is 12 times 7?"}\n')
    base = [f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "prompts=jsonl",
            f"prompts.path={prompts}", "max_new_tokens=8", "warmup_tokens=2", "progress=false",
            "sampling=greedy", f"out={tmp_path}/out/${{method.name}}"]
    heads = {"paper": AcceptanceHead(tiny_pair.draft_hidden, 1, draft=tiny_pair.draft),
             "next": NextTokenHead(tiny_pair.draft_hidden, 1, draft=tiny_pair.draft)}
    for kind, head in heads.items():
        head.save_pretrained(tmp_path / f"head_{kind}")
    rows = {}
    for name, overrides in {"target_only": ["method=target_only"],
                            "pearl": ["method=pearl", "method.gamma=3"],
                            "pearl_auto_svip": ["method=pearl", "method.stop=svip", "method.threshold=0.5"],
                            **{f"pearl_{kind}": ["method=pearl", "method.gamma=3", "method.stop=specdecpp",
                                                 f"method.head={tmp_path}/head_{kind}", "method.threshold=0.3"]
                               for kind in heads}}.items():
        rows[name] = read_rows(app.run(make_cfg(*base, *overrides))["path"])
    reference = [r["output_ids"] for r in rows["target_only"]]
    assert (rows["pearl_next"][0]["tag"] == "g3_head_next_h0.3"
            and rows["pearl_next"][0]["settings"]["head_kind"] == "next")
    for name in ("pearl", "pearl_auto_svip", "pearl_paper", "pearl_next"):
        assert [r["output_ids"] for r in rows[name]] == reference, name
        for r in rows[name]:
            assert r["method"] == "pearl" and r["wall_time_s"] > 0 and r["forward_time_s"] is None
            assert 0 <= r["overlap_time_s"] <= min(r["draft_time_s"], r["target_time_s"]) + 1e-6
            assert r["n_pre_verify_rounds"] + r["n_post_verify_rounds"] == r["n_target"]
            assert r["n_draft"] + r["n_target"] == r["n_generated"] + r["n_discarded"] + r["n_no_target_token"]
    assert rows["pearl"][0]["tag"] == "g3" and rows["pearl"][0]["gamma_used"] == 3
    auto = rows["pearl_auto_svip"][0]
    assert auto["tag"] == "gauto_svip_h0.5_c0.15" and auto["settings"]["gamma"] == "auto"
    assert auto["gamma_used"] >= 1 and set(auto["theorem1_costs"]) == {"t_draft_s", "t_target_s"}
    report = build_report(tmp_path / "out", tmp_path / "report")
    entries = {e["tag"]: e for e in report["groups"][0]["entries"]}
    assert entries["g3"]["both_busy_share"] is not None and entries["g3"]["predicted_tokens_per_s"] is None
    assert entries["g3"]["speedup"] is not None and entries["g3"]["gamma_used"] == [3]
    assert "| pearl | g3 |" in report["text"] and "both busy" in report["text"]


@pytest.mark.parametrize("override,match", [("method.gamma=0", "gamma"), ("method.stop=other", "stop"),
                                            ("method.stop=specdecpp", "method.head"),
                                            ("method.num_threads=0", "num_threads"),
                                            ("method.switch_interval=-1", "switch_interval")])
def test_infer_pearl_bad_settings_are_refused(override, match):
    from infer.methods import resolve_method
    from tests.helpers.infer import make_cfg

    cfg = make_cfg("method=pearl", override)
    with pytest.raises(ValueError, match=match):
        resolve_method(cfg.method, "draft", SamplingConfig())
