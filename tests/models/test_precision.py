"""Precision: ``dtype=fast`` picks bf16 where the CPU multiplies bf16 natively; a bf16 pair stays
lossless and data_gen labels it like the float32 pair up to bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from data_gen import run
from specdecpp import SVIP, FixedK, SamplingConfig, SpeculativeDecoder
from specdecpp.core.sampling import warp
from specdecpp.data.dataset import load_labelled
from specdecpp.models.loading import cpu_has_native_bf16, load_model, resolve_dtype
from tests.helpers.data_gen import make_cfg
from tests.helpers.stats import chi_square_pvalue, exact_distribution
from tests.helpers.tiny import noisy_copy, tiny_lm


@pytest.mark.parametrize("caps,expected", [({"avx512_bf16": True}, torch.bfloat16),
                                           ({"amx_bf16": True, "avx512_bf16": False}, torch.bfloat16),
                                           ({"avx512_bf16": False, "amx_bf16": False}, torch.float32),
                                           ({}, torch.float32)])
def test_fast_dtype_follows_the_cpus_bf16_instructions(monkeypatch, caps, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert cpu_has_native_bf16() == (expected == torch.bfloat16)
    assert resolve_dtype("fast", torch.device("cpu")) == expected
    assert resolve_dtype("fast", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32  # auto is unchanged


def test_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match="auto, fast, float32"):
        resolve_dtype("float8")


def test_load_model_with_fast_dtype(tiny_pair, monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True})
    assert load_model(tiny_pair.draft, "cpu", "fast").dtype == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {})
    assert load_model(tiny_pair.draft, "cpu", "fast").dtype == torch.float32


@pytest.fixture(scope="module")
def pair6_bf16():
    target = tiny_lm(5, 16, 2, seed=21, scale=0.8, heads=2)
    draft = noisy_copy(target, 0.25, seed=22)
    return draft.to(torch.bfloat16), target.to(torch.bfloat16)


@pytest.mark.parametrize("policy,sampling", [  # 1,200 bf16 decodes each: make test runs the second
    pytest.param(FixedK(3), SamplingConfig(temperature=1.0), marks=pytest.mark.slow),
    (SVIP(threshold=0.33, max_candidates=4), SamplingConfig(temperature=1.0, top_k=3)),
])
def test_bf16_pair_samples_the_bf16_targets_distribution(pair6_bf16, policy, sampling):
    """Lossless at bf16 too: the first 3 tokens follow the bf16 target's own warped distribution
    (enumerated with the bf16 target alone; the engine's multi-token bf16 forwards round
    differently from these one-prefix forwards, far below what 1,200 samples can see)."""
    draft, target = pair6_bf16
    prompt = [0, 1]
    expected = exact_distribution(target, prompt, 3, sampling)
    decoder = SpeculativeDecoder(draft, target, policy, sampling)
    g = torch.Generator().manual_seed(99)
    seqs, accepted = [], 0
    for _ in range(1200):
        out = decoder.generate(torch.tensor([prompt]), max_new_tokens=4, generator=g)
        seqs.append(tuple(out.tokens[0, 2:5].tolist()))
        accepted += sum(out.stats.accept_lengths)
    assert chi_square_pvalue(seqs, expected) > 1e-4
    assert accepted > 300  # candidates are accepted, not only resampled


@pytest.mark.slow  # a negative control of the chi-square test, as test_chain.py's (which make test runs)
def test_bf16_test_rejects_the_float32_draft_alone(pair6_bf16):
    """Negative control for the test above at bf16: the draft's own samples fail it."""
    draft, target = pair6_bf16
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_distribution(target, [0, 1], 3, sampling)
    alone = SpeculativeDecoder(target, draft, FixedK(1), sampling)  # the draft in the target's seat
    g = torch.Generator().manual_seed(5)
    seqs = [tuple(alone.generate(torch.tensor([[0, 1]]), 3, generator=g).tokens[0, 2:].tolist()) for _ in range(1200)]
    assert chi_square_pvalue(seqs, expected) < 1e-6


def test_data_gen_at_bf16_labels_like_float32(tiny_pair, prompts_file, tmp_path):
    """data_gen with pair.dtype=bfloat16 records the precision, and its labels P_i = min(1, p/q) for
    the tokens it sampled equal the float32 pair's labels for the same tokens up to bf16 rounding."""
    out = tmp_path / "bf16"
    result = run(make_cfg(tiny_pair, prompts_file, out, "pair.dtype=bfloat16"))
    assert result.complete
    splits, meta = load_labelled(out)
    assert meta["dtype"] == "bfloat16"
    sampling = SamplingConfig(**meta["sampling"])
    draft32, target32 = load_model(tiny_pair.draft, "cpu", "float32"), load_model(tiny_pair.target, "cpu", "float32")
    got, ref = [], []
    with torch.no_grad():
        for split in splits.values():
            for row in split:
                ids = torch.tensor([row["prompt_ids"] + row["target_ids"][:-1]])
                start = len(row["prompt_ids"]) - 1
                p = warp(target32(ids).logits[0, start:], sampling)
                q = warp(draft32(ids).logits[0, start:], sampling)
                y = torch.tensor(row["draft_ids"])
                rows = torch.arange(len(y))
                # a token at the edge of the top-k set may be in one precision's support only
                qy = q[rows, y]
                ref.append(torch.where(qy > 0, torch.clamp(p[rows, y] / qy, max=1.0), torch.nan))
                got.append(torch.tensor(row["p_acc"]))
    got, ref = torch.cat(got), torch.cat(ref)
    assert got.numel() == 7 * 8
    both = ~ref.isnan()
    assert both.float().mean() > 0.9
    got, ref = got[both], ref[both]
    assert (got - ref).abs().mean() < 0.02 and (got - ref).abs().max() < 0.15
    assert torch.corrcoef(torch.stack([got, ref]))[0, 1] > 0.98
    # and a float32 run's labels are not what a bf16 run recorded (the precision really changed)
    assert not torch.equal(got, ref)


def test_potential_scores_heads_on_the_draft_at_the_datasets_precision(monkeypatch):
    """infer.potential loads the draft at the precision recorded in the dataset's meta."""
    import infer.potential as ip

    seen = {}

    def fake_load_model(ref, device, dtype):
        seen.update(ref=ref, dtype=dtype)
        raise RuntimeError("loaded")

    monkeypatch.setattr("specdecpp.models.loading.load_model", fake_load_model)
    monkeypatch.setattr("specdecpp.stopping.head.load_head", lambda d: None)
    with pytest.raises(RuntimeError, match="loaded"):
        ip.heads_predictions(["h"], [], {"draft": "somewhere", "dtype": "bfloat16"})
    assert seen == {"ref": "somewhere", "dtype": "bfloat16"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_last_gives_the_logits_of_the_plain_slice(dtype):
    """The index form of logits_to_keep (what avoids bf16's slow strided path on CPU) gives the
    same logits as transformers' own int slice, for the last k of n positions."""
    from specdecpp.core.hooks import keep_last

    model = tiny_lm(40, 32, 2, seed=3).to(dtype)
    ids = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(0))
    for k in (1, 3, 9, 12):
        keep = keep_last(9, k, ids.device)
        assert isinstance(keep, int) == (k >= 9)
        with torch.no_grad():
            got = model(ids, logits_to_keep=keep).logits
            ref = model(ids, logits_to_keep=k).logits
        assert got.shape == ref.shape == (1, min(k, 9), 40)
        torch.testing.assert_close(got, ref)
        assert got.is_contiguous()


def test_gather_kept_logits_rewrites_short_keeps_and_leaves_hf_assisted_output_unchanged():
    """transformers' assisted generation feeds its draft 2-3 tokens keeping 1 logit; inside
    GatherKeptLogits those int keeps become keep_last's index (the bf16 fast path), every other
    call is left alone, the generated tokens are the same, and the hooks go away on exit."""
    from specdecpp.core.hooks import GatherKeptLogits

    draft, target = tiny_lm(40, 16, 1, seed=5), tiny_lm(40, 32, 2, seed=6)
    for m in (draft, target):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    seen = []
    spy = lambda name: lambda mod, args, kwargs: seen.append(  # noqa: E731
        (name, kwargs.get("input_ids").shape[1], kwargs.get("logits_to_keep")))
    ids = torch.randint(1, 40, (1, 7), generator=torch.Generator().manual_seed(1))

    def run(hooked: bool, do_sample: bool):
        seen.clear()
        handles = []
        try:
            if hooked:
                ctx = GatherKeptLogits(draft, target)
                ctx.__enter__()
            # registered after GatherKeptLogits's hooks: the spy sees what the model receives
            handles = [m.register_forward_pre_hook(spy(n), with_kwargs=True) for n, m in (("d", draft), ("t", target))]
            draft.generation_config.num_assistant_tokens = 3
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            torch.manual_seed(0)
            with torch.no_grad():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                                      do_sample=do_sample, top_k=20, max_new_tokens=24, min_new_tokens=24)
        finally:
            for h in handles:
                h.remove()
            if hooked:
                ctx.__exit__(None, None, None)
        return out, list(seen)

    for do_sample in (False, True):
        plain, plain_calls = run(False, do_sample)
        hooked, hooked_calls = run(True, do_sample)
        assert torch.equal(plain, hooked)
        short = [c for c in plain_calls if isinstance(c[2], int) and 0 < c[2] < c[1]]
        assert any(c[0] == "d" for c in short)  # the case exists: draft fed several tokens, keeping 1
        for (name, n, k), (name2, n2, k2) in zip(plain_calls, hooked_calls, strict=True):
            assert (name, n) == (name2, n2)
            if isinstance(k, int) and 0 < k < n:
                assert torch.is_tensor(k2) and k2.tolist() == list(range(n - k, n))
            else:
                assert k2 == k
    assert not draft._forward_pre_hooks and not target._forward_pre_hooks
