"""Speculative cascades are lossy on purpose, and exact against their own target pi: every emitted
token (the bonus included) follows pi = T(q, p) at its position, computed here directly from both
models; the rules' formulas recomputed by hand; the exact and the draft-only ends; greedy limits;
same seed, same output. The batched decoder (``generate_batch``, mode ``batch``) runs the same
tests with the test prompt in several rows of a batch of mixed prompts. Each decoder test also
runs on CUDA under the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch
from test_exactness import DEVICES, _pair6, on

from specdecpp import SVIP, Cascade, FixedK, SamplingConfig, SpeculativeDecoder, TargetOnly, warp
from specdecpp.decoders.cascade import RULES
from tests.helpers.stats import (
    chi_square_pvalue,
    exact_distribution,
    sampled_grid,
    sequence_distribution,
)

PROMPT = [0, 1]


# -- the rules, recomputed by hand ------------------------------------------------------------------
def _by_hand(rule: str, alpha: float, q: list[float], p: list[float]) -> list[float]:
    max_q, max_p = max(q), max(p)
    tv = sum(max(0.0, a - b) for a, b in zip(p, q, strict=True))
    if rule in ("chow", "diff", "opt"):
        defer = {"chow": max_q < 1 - alpha, "diff": max_q < max_p - alpha,
                 "opt": max_q < max_p - alpha * tv}[rule]
        return list(p) if defer else list(q)
    r = [{"token_v1": qv < max_p - alpha, "token_v2": pv < max_p - alpha,
          "token_v3": pv < (1 - alpha) * max_p}[rule] for qv, pv in zip(q, p, strict=True)]
    eta = sum(qv for qv, rv in zip(q, r, strict=True) if rv)
    return [qv * (0 if rv else 1) + pv * eta for qv, pv, rv in zip(q, p, r, strict=True)]


Q = [0.5, 0.3, 0.15, 0.05]
P = [0.2, 0.6, 0.1, 0.1]
ALPHAS = [0.0, 0.07, 0.33, 0.42, 0.9]  # no ties with the thresholds (float32 vs float64)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("alpha", ALPHAS)
def test_target_matches_the_formulas_and_is_a_distribution(rule, alpha):
    pi = Cascade(rule, alpha).target(torch.tensor([Q]), torch.tensor([P]))[0]
    assert pi.tolist() == pytest.approx(_by_hand(rule, alpha, Q, P), abs=1e-6)
    assert float(pi.sum()) == pytest.approx(1.0, abs=1e-6) and (pi >= 0).all()


def test_both_branches_occur_in_the_sweep():
    """Over the alphas above, every sequence-level rule both defers (pi = p) and keeps q."""
    for rule in ("chow", "diff", "opt"):
        outs = {tuple(_by_hand(rule, a, Q, P)) for a in ALPHAS}
        assert outs == {tuple(P), tuple(Q)}, rule


@pytest.mark.parametrize("bad,match", [(("nope", 0.1), "rule"), (("opt", -0.1), "alpha"),
                                       (("opt", True), "alpha"), (("chow", float("nan")), "alpha")])
def test_bad_cascades_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        Cascade(*bad)


def test_a_cascade_must_be_a_cascade():
    draft, target = _pair6()
    with pytest.raises(TypeError, match="cascade"):
        SpeculativeDecoder(draft, target, FixedK(2), cascade=("opt", 0.1))


# -- the decoder follows pi ---------------------------------------------------------------------------
def pi_distribution(draft, target, cascade: Cascade, prompt, n_tokens, sampling):
    """P(first n_tokens) when every position samples from pi = T(q, p) of that prefix."""
    def pi(ids):
        q = warp(draft(torch.tensor([ids])).logits[0, -1], sampling)
        return cascade.target(q, warp(target(torch.tensor([ids])).logits[0, -1], sampling))

    return sequence_distribution(pi, prompt, n_tokens)


@pytest.fixture(scope="module")
def pair6():
    return _pair6()


MIXED = [PROMPT, [3], PROMPT, [4, 1, 0, 2, 1], PROMPT, PROMPT]  # a batch: the test prompt in 4 rows


def _sample(decoder, device, n_samples=1200, max_new_tokens=3, seed=5, mode="chain"):
    """``n_samples`` samples of the first two tokens after PROMPT: one ``generate`` call each
    (chain), or (batch) four rows of each ``generate_batch`` call of :data:`MIXED`, every row with
    its own generator."""
    seqs, accepted = [], 0
    if mode == "batch":
        rows = [b for b, p in enumerate(MIXED) if p == PROMPT]
        for call in range(n_samples // len(rows)):
            gens = [torch.Generator().manual_seed(seed * 100_000 + 10 * call + b) for b in range(len(MIXED))]
            outs = decoder.generate_batch([torch.tensor(p, device=device) for p in MIXED], max_new_tokens, gens)
            for b in rows:
                seqs.append(tuple(outs[b].tokens[0, len(PROMPT): len(PROMPT) + 2].tolist()))
                accepted += sum(outs[b].stats.accept_lengths)
        return seqs, accepted
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_samples):
        out = decoder.generate(torch.tensor([PROMPT], device=device), max_new_tokens, generator=g)
        seqs.append(tuple(out.tokens[0, len(PROMPT): len(PROMPT) + 2].tolist()))
        accepted += sum(out.stats.accept_lengths)
    return seqs, accepted


MODES = ["chain", "batch"]


CASES = [  # alphas where the rule both defers and keeps q on this pair's first two positions
    ("chow", 0.3, FixedK(2), SamplingConfig(temperature=1.0)),
    ("diff", 0.1, FixedK(3), SamplingConfig(temperature=1.0)),
    ("opt", 0.3, SVIP(threshold=0.33, max_candidates=3), SamplingConfig(temperature=1.0, top_k=3)),
    ("token_v1", 0.2, FixedK(2), SamplingConfig(temperature=1.0)),
    ("token_v2", 0.8, FixedK(1), SamplingConfig(temperature=0.8, top_k=4)),
    ("token_v3", 0.8, TargetOnly(), SamplingConfig(temperature=1.0)),
]


@pytest.mark.parametrize("rule,alpha,policy,sampling,mode,device", sampled_grid(
    [pytest.param(*c, id=c[0]) for c in CASES], [pytest.param(m, id=m) for m in MODES], DEVICES,
    fast={"opt-chain", "token_v2-batch"}))  # on the CPU, the other rules and modes: make test-full
def test_samples_follow_the_cascade_target_pi(pair6, rule, alpha, policy, sampling, mode, device):
    draft, target = pair6
    cascade = Cascade(rule, alpha)
    expected = pi_distribution(draft, target, cascade, PROMPT, 2, sampling)
    exact = exact_distribution(target, PROMPT, 2, sampling)
    tv = 0.5 * sum(abs(expected.get(s, 0.0) - exact.get(s, 0.0)) for s in set(expected) | set(exact))
    assert tv > 0.02, tv  # pi is not p here: lossy
    d, t, _ = on(device, (draft, target, {}))
    seqs, accepted = _sample(SpeculativeDecoder(d, t, policy, sampling, cascade=cascade), device, mode=mode)
    assert chi_square_pvalue(seqs, expected) > 1e-4
    if not isinstance(policy, TargetOnly):
        assert accepted > 300


@pytest.mark.parametrize("mode,device", sampled_grid([pytest.param(m, id=m) for m in MODES], DEVICES,
                                                     fast={"batch"}))  # chain on the CPU: make test-full
def test_the_exact_end_is_exact_decoding_and_the_other_end_is_the_draft(pair6, mode, device):
    """chow with alpha = 0 defers wherever q is not one-hot: the target's own distribution; opt with
    a huge alpha never defers: the draft's own distribution (the bonus token included)."""
    draft, target = pair6
    sampling = SamplingConfig(temperature=1.0)
    d, t, _ = on(device, (draft, target, {}))
    seqs, _ = _sample(SpeculativeDecoder(d, t, FixedK(2), sampling, cascade=Cascade("chow", 0.0)), device, mode=mode)
    assert chi_square_pvalue(seqs, exact_distribution(target, PROMPT, 2, sampling)) > 1e-4
    seqs, accepted = _sample(SpeculativeDecoder(d, t, FixedK(2), sampling, cascade=Cascade("opt", 1e9)), device,
                             mode=mode)
    assert chi_square_pvalue(seqs, exact_distribution(draft, PROMPT, 2, sampling)) > 1e-4
    assert chi_square_pvalue(seqs, exact_distribution(target, PROMPT, 2, sampling)) < 1e-6  # and not the target's
    assert accepted == 1200 * 2  # q = pi: every candidate accepted


def test_the_bonus_token_follows_pi(pair6):
    """With K = 1 and 2 tokens, the second token is the bonus token whenever the first candidate is
    accepted; its conditional distribution given the first must be pi's, not p's."""
    draft, target = pair6
    sampling = SamplingConfig(temperature=1.0)
    cascade = Cascade("token_v3", 0.95)  # pi mixes q and p at both positions; most y_1 accepted
    decoder = SpeculativeDecoder(draft, target, FixedK(1), sampling, cascade=cascade)
    g = torch.Generator().manual_seed(11)
    seconds = []
    for _ in range(2000):
        out = decoder.generate(torch.tensor([PROMPT]), 2, generator=g)
        if out.stats.accept_lengths[0] == 1:  # the second token was the round's bonus
            seconds.append(tuple(out.tokens[0, 2:4].tolist()))
    assert len(seconds) > 500
    first = max(set(s[0] for s in seconds), key=[s[0] for s in seconds].count)
    sub = [(s[1],) for s in seconds if s[0] == first]
    with torch.no_grad():
        ids = torch.tensor([PROMPT + [first]])
        pi = cascade.target(warp(draft(ids).logits[0, -1], sampling), warp(target(ids).logits[0, -1], sampling))
        p = warp(target(ids).logits[0, -1], sampling)
    assert chi_square_pvalue(sub, {(v,): float(pi[v]) for v in range(5)}) > 1e-4
    assert chi_square_pvalue(sub, {(v,): float(p[v]) for v in range(5)}) < 1e-3


# -- greedy limits, determinism ----------------------------------------------------------------------
def greedy_pi_decoding(draft, target, cascade, prompt, n):
    """The paper's greedy limit, token by token: confidences from the softmax, pi from one-hots."""
    greedy, ids = SamplingConfig(temperature=0), list(prompt)
    for _ in range(n):
        with torch.no_grad():
            dl, tl = draft(torch.tensor([ids])).logits[0, -1], target(torch.tensor([ids])).logits[0, -1]
        pi = cascade.target(warp(dl, greedy), warp(tl, greedy), torch.softmax(dl, -1), torch.softmax(tl, -1))
        ids.append(int(pi.argmax()))
    return ids


@pytest.fixture(scope="module")
def pair32():
    from tests.helpers.tiny import noisy_copy, tiny_lm

    target = tiny_lm(32, 32, 2, seed=5, scale=0.4)
    return noisy_copy(target, 0.3, seed=6), target


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule,alpha", [("chow", 0.6), ("diff", 0.02), ("opt", 0.3), ("token_v1", 0.05),
                                        ("token_v3", 0.4)])
def test_greedy_follows_the_greedy_limit_of_pi(pair32, rule, alpha, mode, device):
    draft, target = pair32
    cascade = Cascade(rule, alpha)
    d, t, _ = on(device, (draft, target, {}))
    decoder = SpeculativeDecoder(d, t, FixedK(3), SamplingConfig(temperature=0), cascade=cascade)
    differs_from_target = False
    prompts = ([1, 2, 3], [7], [4, 4, 9, 10])
    batched = (decoder.generate_batch([torch.tensor(p, device=device) for p in prompts], 16, batch_size=2)
               if mode == "batch" else None)  # two slots: the third prompt joins when a row finishes
    for j, prompt in enumerate(prompts):
        ref = greedy_pi_decoding(draft, target, cascade, prompt, 16)
        out = batched[j] if batched else decoder.generate(torch.tensor([prompt], device=device), 16)
        assert out.tokens[0].tolist() == ref, prompt
        plain = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()
        differs_from_target |= plain != ref
    if rule != "chow":
        assert differs_from_target  # lossy: the greedy output is not the target's own


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_output(pair32, mode, device):
    d, t, _ = on(device, (*pair32, {}))
    decoder = SpeculativeDecoder(d, t, FixedK(3), SamplingConfig(temperature=1.0, top_k=10),
                                 cascade=Cascade("opt", 0.2))

    def run(seed):
        if mode == "batch":
            gens = [torch.Generator().manual_seed(seed + 7 * b) for b in range(3)]
            outs = decoder.generate_batch([torch.tensor(p, device=device) for p in ([1, 2], [5], [3, 3, 3])], 24, gens)
            return [o.tokens.tolist() for o in outs]
        return decoder.generate(torch.tensor([[1, 2]], device=device), 24,
                                generator=torch.Generator().manual_seed(seed)).tokens.tolist()

    assert run(0) == run(0) and run(0) != run(1)


# -- in the harness: method=cascade, lossy rows, quality, the report ----------------------------------
def test_infer_cascade_rows_are_lossy_with_quality_and_the_report_shows_them(tiny_pair, tmp_path):
    from infer import app
    from infer.report import build_report
    from infer.results import read_rows
    from specdecpp import AcceptanceHead, load_pair
    from specdecpp.analysis.quality import target_quality
    from tests.helpers.infer import make_cfg

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n'
                       '{"id": "math", "prompt": "What is 12 times 7?"}\n')
    AcceptanceHead(tiny_pair.draft_hidden, 1, draft=tiny_pair.draft).save_pretrained(tmp_path / "head")
    base = [f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "prompts=jsonl",
            f"prompts.path={prompts}", "max_new_tokens=8", "warmup_tokens=2", "progress=false",
            "sampling=greedy", f"out={tmp_path}/out/${{method.name}}"]
    rows = {name: read_rows(app.run(make_cfg(*base, *overrides))["path"]) for name, overrides in {
        "target_only": ["method=target_only"],
        "fixed_k": ["method=fixed_k", "method.k=3"],
        "cascade": ["method=cascade", "method.rule=diff", "method.alpha=0.5", "method.k=3"],
        "cascade_head": ["method=cascade", "method.rule=opt", "method.alpha=0.1", "method.stop=specdecpp",
                         f"method.head={tmp_path}/head", "method.threshold=0.5", "method.allow_label_mismatch=true"],
    }.items()}
    assert rows["cascade"][0]["tag"] == "diff_a0.5_k3" and rows["cascade_head"][0]["tag"] == "opt_a0.1_head_h0.5"
    assert all(r["lossy"] for name in ("cascade", "cascade_head") for r in rows[name])
    assert not any(r["lossy"] for name in ("target_only", "fixed_k") for r in rows[name])
    for r in rows["target_only"] + rows["fixed_k"]:  # exact greedy: every token is the target's argmax
        assert r["greedy_match"] == 1.0
    # quality recomputed independently for one cascade row
    draft, target, tok = load_pair(tiny_pair.draft, tiny_pair.target)
    from specdecpp.data.prompts import encode_prompt

    row = rows["cascade"][0]
    ids = torch.tensor([encode_prompt(tok, {"sea": "Write a short poem about the sea.",
                                            "math": "What is 12 times 7?"}[row["prompt_id"]])])
    with torch.no_grad():
        full = target(torch.tensor([ids[0].tolist() + row["output_ids"]])).logits[0]
    logits = full[ids.shape[1] - 1 : -1]
    out = torch.tensor(row["output_ids"])
    match = float((logits.argmax(-1) == out).float().mean())
    logp = float(torch.log_softmax(logits, -1).gather(-1, out[:, None]).mean())
    assert (row["greedy_match"] == pytest.approx(match)
            and row["target_logprob_per_token"] == pytest.approx(logp, abs=1e-4))
    assert target_quality(target, ids, [], SamplingConfig(temperature=0))["greedy_match"] is None
    report = build_report(tmp_path / "out", tmp_path / "report")
    assert "| cascade (LOSSY) | diff_a0.5_k3 |" in report["text"]
    assert any(p.name.startswith("quality_") and p.exists() for p in report["images"])
    # batched (generate_batch): the same greedy outputs, lossy rows with their quality
    batched = read_rows(app.run(make_cfg(*base, "method=cascade", "method.rule=diff", "method.alpha=0.5", "method.k=3",
                                         "batch_size=2", f"out={tmp_path}/batched"))["path"])
    assert [(r["prompt_id"], r["output_ids"]) for r in batched] == [(r["prompt_id"], r["output_ids"])
                                                                    for r in rows["cascade"]]
    assert all(r["lossy"] and r["batch_size"] == 2 and r["greedy_match"] is not None for r in batched)


def test_infer_bad_cascade_settings_are_the_constructors_errors():
    from infer.methods import resolve_method
    from tests.helpers.infer import make_cfg

    for override, match in (("method.rule=nope", "rule"), ("method.alpha=-1", "alpha"),
                            ("method.stop=other", "stop"), ("method.stop=specdecpp", "method.head"),
                            ("method.k=0", "k")):
        with pytest.raises(ValueError, match=match):
            resolve_method(make_cfg("method=cascade", override).method, "draft", SamplingConfig())


# -- labels under a cascade (data_gen labels.cascade), and heads trained on them -------------------------
def test_data_gen_labels_under_a_cascade_equal_an_independent_recomputation(tiny_pair, tmp_path):
    from data_gen import run
    from specdecpp.data.dataset import load_labelled
    from specdecpp.models.loading import load_model
    from tests.helpers.data_gen import PROMPTS, make_cfg, recompute_row

    prompts_file = tmp_path / "prompts.jsonl"
    import json

    prompts_file.write_text("".join(json.dumps({"id": i, "split": s, "prompt": p}) + "\n" for i, s, p in PROMPTS))
    cascade = Cascade("token_v3", 0.9)
    out = tmp_path / "data"
    run(make_cfg(tiny_pair, prompts_file, out, "labels.cascade={rule: token_v3, alpha: 0.9}", "splits=[dev]"))
    splits, meta = load_labelled(out)
    assert meta["labels"] == {"cascade": {"rule": "token_v3", "alpha": 0.9}}
    draft, target = load_model(tiny_pair.draft, "cpu"), load_model(tiny_pair.target, "cpu")
    sampling = SamplingConfig.from_mapping(meta["sampling"])
    lenient = 0
    for row in splits["dev"]:
        ref = recompute_row(row, draft, target, sampling, meta["seed"], meta["max_new_tokens"],
                            tiny_pair.tokenizer.eos_token_id)
        assert row["draft_ids"] == ref["draft_ids"]
        prefix, response = list(row["prompt_ids"]), row["target_ids"]
        with torch.no_grad():
            d = torch.stack([draft(torch.tensor([prefix + response[:i]])).logits[0, -1] for i in range(len(response))])
            t = torch.stack([target(torch.tensor([prefix + response[:i]])).logits[0, -1] for i in range(len(response))])
        q, p = warp(d, sampling), warp(t, sampling)
        y = torch.tensor(row["draft_ids"])
        rows = torch.arange(len(response))
        pi = torch.tensor([_by_hand("token_v3", 0.9, qi.tolist(), pj.tolist()) for qi, pj in zip(q, p, strict=True)])
        expected = torch.clamp(pi[rows, y] / q[rows, y], max=1.0)
        torch.testing.assert_close(torch.tensor(row["p_acc"]), expected.float(), atol=1e-5, rtol=1e-4)
        lenient += int((expected > ref["p_acc"] + 1e-6).sum())
    assert lenient > 0  # the cascade accepts some tokens the exact rule would not
    assert cascade.rule == meta["labels"]["cascade"]["rule"]


def test_data_gen_refuses_cascade_labels_under_greedy_and_bad_rules(tiny_pair, tmp_path):
    from data_gen import run
    from tests.helpers.data_gen import make_cfg

    with pytest.raises(ValueError, match="temperature > 0"):
        run(make_cfg(tiny_pair, tmp_path / "p.jsonl", tmp_path / "a", "labels.cascade={rule: opt, alpha: 0.1}",
                     "sampling=greedy", "prompts=bundled", "splits=[dev]", "limit=1"))
    with pytest.raises(ValueError, match="rule"):
        run(make_cfg(tiny_pair, tmp_path / "p.jsonl", tmp_path / "b", "labels.cascade={rule: nope, alpha: 0.1}",
                     "prompts=bundled", "splits=[dev]", "limit=1"))


def test_infer_refuses_a_head_trained_under_another_rule(tiny_pair, tmp_path):
    from infer.methods import resolve_method
    from specdecpp import AcceptanceHead
    from tests.helpers.infer import make_cfg

    def head_with(labels, name):
        head = AcceptanceHead(tiny_pair.draft_hidden, 1, draft=tiny_pair.draft)
        head.meta = {"training": {"dataset_meta": {"sampling": {"temperature": 1.0, "top_k": 50, "top_p": 1.0},
                                                   **({"labels": labels} if labels else {})}}}
        head.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    exact, opt = head_with(None, "exact"), head_with({"cascade": {"rule": "opt", "alpha": 0.1}}, "opt")
    sampling = SamplingConfig(temperature=1.0, top_k=50)
    cascade = ["method=cascade", "method.rule=opt", "method.alpha=0.1", "method.stop=specdecpp"]
    resolve_method(make_cfg(*cascade, f"method.head={opt}").method, tiny_pair.draft, sampling)  # the same rule
    with pytest.raises(ValueError, match="exact min.*cascade opt alpha=0.1"):
        resolve_method(make_cfg(*cascade, f"method.head={exact}").method, tiny_pair.draft, sampling)
    with pytest.raises(ValueError, match="cascade opt alpha=0.1.*exact"):
        resolve_method(make_cfg("method=specdecpp", f"method.head={opt}").method, tiny_pair.draft, sampling)
    resolve_method(make_cfg(*cascade, f"method.head={exact}", "method.allow_label_mismatch=true").method,
                   tiny_pair.draft, sampling)


def test_a_head_trained_on_cascade_labels_records_the_rule(tiny_pair, tmp_path):
    """train copies the dataset's labels rule into the head's config, which infer's check reads."""
    import json

    from specdecpp import load_head
    from tests.helpers.train import base_overrides, random_rows, save_dataset, train_cfg
    from train import run

    data = save_dataset(tmp_path / "data", {"train": random_rows(16, tiny_pair.vocab, 1),
                                            "dev": random_rows(4, tiny_pair.vocab, 2)},
                        tiny_pair.draft, tiny_pair.draft_hidden, tiny_pair.vocab)
    meta = json.loads((data / "specdecpp_meta.json").read_text())
    meta["labels"] = {"cascade": {"rule": "opt", "alpha": 0.05}}
    (data / "specdecpp_meta.json").write_text(json.dumps(meta))
    out = run(train_cfg(base_overrides(tiny_pair, data, tmp_path, "trainer=smoke")))
    head = load_head(out["out"])
    assert head.meta["training"]["dataset_meta"]["labels"] == {"cascade": {"rule": "opt", "alpha": 0.05}}
