"""The apps chained on a tiny feature draft (EAGLE-3): data_gen labels it by depth, train fits a lag-free
head on those labels in their own context, the potential tool replays it, and the chain decodes with it
exactly (greedy equal to the target's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdecpp import NextTokenHead, SamplingConfig, SpecDecPP, SpeculativeDecoder, load_pair
from specdecpp.models.loading import load_model
from tests.helpers.paths import CONF
from tests.helpers.tiny import perturbed_feature_draft
from tests.helpers.train import base_overrides, train_cfg
from train import run


@pytest.fixture(scope="module")
def feature_data(tiny_pair, tmp_path_factory):
    from data_gen import run as generate

    root = tmp_path_factory.mktemp("feature_pipeline")
    target = load_model(tiny_pair.target, "cpu")
    draft = perturbed_feature_draft(target)
    draft.save_pretrained(root / "feature")
    prompts = root / "prompts.jsonl"
    texts = ["Write a short poem about the sea.", "What is 12 times 7?", "def add(a, b):", "Explain binary search.",
             "Name three colours."]
    prompts.write_text("".join(json.dumps({"id": f"p{j}", "split": "train" if j < 3 else "dev", "prompt": t}) + "\n"
                               for j, t in enumerate(texts)))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        generate(compose("data_gen", overrides=[
            f"pair.draft={root / 'feature'}", f"pair.target={tiny_pair.target}", "pair.device=cpu", "prompts=jsonl",
            f"prompts.path={prompts}", "splits=[train,dev]", f"out={root / 'data'}", "max_new_tokens=8",
            "feature_depths=3", "progress=false"]))
    return root


def test_a_lag_free_head_trains_on_a_feature_drafts_labels_and_decodes_exactly(tiny_pair, feature_data, tmp_path):
    data, draft_dir = feature_data / "data", feature_data / "feature"
    overrides = [*base_overrides(tiny_pair, data, tmp_path, "trainer=smoke", "callbacks=none"),
                 f"pair.draft={draft_dir}", "head=next", "head.depth=1", "data.feature_context=target"]
    result = run(train_cfg(overrides))
    head = NextTokenHead.from_pretrained(result["out"])
    # a row per (position, depth): 3 depths of each of the 8 tokens of 3 train prompts (none too short here)
    assert result["metrics"]["train"]["positions"] == 3 * 8 * 3
    draft, target, _ = load_pair(str(draft_dir), tiny_pair.target, device="cpu")
    head.attach(draft)
    decoder = SpeculativeDecoder(draft, target, SpecDecPP(head, 0.5, max_candidates=3), SamplingConfig(temperature=0))
    prompt = torch.tensor([[5, 9, 13, 2, 7]])
    out = decoder.generate(prompt, max_new_tokens=12)
    assert out.tokens.tolist() == target.generate(prompt, max_new_tokens=12, do_sample=False).tolist()
    # the paper's head, or the mixed context, is refused with what to use instead
    for extra in (["head=resnet"], ["head=next", "data.feature_context=mixed"]):
        with pytest.raises(ValueError, match="head=next with data.feature_context=target"):
            run(train_cfg([*base_overrides(tiny_pair, data, tmp_path / "x", "trainer=smoke", "callbacks=none"),
                           f"pair.draft={draft_dir}", *extra]))


def test_the_potential_tool_replays_a_trained_lag_free_head_by_depth(tiny_pair, feature_data, tmp_path):
    """infer.potential --head on a feature draft's labels: the head's P_hat at every (position, depth),
    equal to the head on train's features there, replayed a round's j-th candidate at depth j."""
    from infer import potential
    from specdecpp.training.mixing import feature_draft_head_features

    data, draft_dir = feature_data / "data", feature_data / "feature"
    result = run(train_cfg([*base_overrides(tiny_pair, data, tmp_path, "trainer=smoke", "callbacks=none"),
                            f"pair.draft={draft_dir}", "head=next", "head.depth=1", "data.feature_context=target"]))
    rows, meta, raw = potential.dataset_rows(data, "dev")
    (preds,) = potential.heads_predictions([result["out"]], raw, meta)
    head = NextTokenHead.from_pretrained(result["out"])
    draft, target, _ = load_pair(str(draft_dir), tiny_pair.target, device="cpu")
    head.attach(draft)
    feats, _ = feature_draft_head_features(draft, target, raw, {**head.feature_spec(), "context": "target"})
    for pred, r, f in zip(preds, raw, feats, strict=True):
        assert pred.shape == np.asarray(r["depth_p_acc"]).shape
        with torch.no_grad():
            np.testing.assert_allclose(pred[~np.isnan(pred)], torch.sigmoid(head(f)).double().numpy(), rtol=1e-5)
    config = potential.PotentialConfig(split="dev", seeds=2, max_k=3, thresholds=(0.5,), svip_thresholds=(0.3,),
                                       n_boot=20, quiet=True, cost_ratio=0.1)
    out = potential.run(str(data), config, heads=[result["out"]], out=str(tmp_path / "pot"))
    assert any(r["name"].startswith("head:") for r in json.loads((tmp_path / "pot" / "potential.json").read_text())[
        "records"]) and out["margins"]
