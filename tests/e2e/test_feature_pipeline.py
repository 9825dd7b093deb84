"""The apps chained on a tiny feature draft (EAGLE-3): data_gen labels it by depth, train fits a lag-free
head and the paper's head on those labels in their own context, the potential tool replays them, and the
chain decodes with them exactly (greedy equal to the target's)."""

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
    # the mixed context is refused, for either head kind, with what to use instead
    for extra in (["head=resnet"], ["head=next", "data.feature_context=mixed"]):
        with pytest.raises(ValueError, match="train with data.feature_context=target"):
            run(train_cfg([*base_overrides(tiny_pair, data, tmp_path / "x", "trainer=smoke", "callbacks=none"),
                           f"pair.draft={draft_dir}", *extra]))


def test_the_papers_head_trains_on_a_feature_drafts_labels_and_decodes_exactly(tiny_pair, feature_data, tmp_path):
    """The paper's head (resnet) on a feature draft's labels: each (position, depth) row's feature is the
    draft's state after feeding that depth's candidate, as the engine hands it the state after each
    candidate; trained, it decodes the target's greedy tokens, and the potential tool replays it with
    its lag."""
    from infer import potential
    from specdecpp import AcceptanceHead
    from specdecpp.models.feature_runner import FeaturePass
    from specdecpp.training.mixing import feature_draft_head_features

    data, draft_dir = feature_data / "data", feature_data / "feature"
    result = run(train_cfg([*base_overrides(tiny_pair, data, tmp_path, "trainer=smoke", "callbacks=none"),
                            f"pair.draft={draft_dir}", "head=resnet", "head.depth=1", "data.feature_context=target"]))
    assert result["metrics"]["train"]["positions"] == 3 * 8 * 3
    head = AcceptanceHead.from_pretrained(result["out"])
    draft, target, _ = load_pair(str(draft_dir), tiny_pair.target, device="cpu")
    head.attach(draft)
    # the features: the state after feeding Y^(d)_i (not the state that drew it, nor after the true X_i)
    rows, meta, raw = potential.dataset_rows(data, "dev")
    feats, labels = feature_draft_head_features(draft, target, raw, {**head.feature_spec(), "context": "target"})
    r = raw[0]
    n, depth_ids = len(r["target_ids"]), torch.as_tensor(r["depth_draft_ids"]).reshape(len(r["target_ids"]), -1)
    plain = FeaturePass(draft, target, [r["prompt_ids"]], [r["target_ids"]], 3)
    valid = ~torch.as_tensor(r["depth_p_acc"], dtype=torch.float32).isnan()
    i = int(valid[:, 1].nonzero()[0])  # a position with a depth-2 label
    prefix = torch.tensor(list(r["prompt_ids"]) + list(r["target_ids"][:i]))
    with torch.no_grad():  # draft X_i's place at depth 2 by hand: after x_<i-1, feed X_{i-1}, then Y^(2)_i
        cache = draft.new_cache()
        g = draft.fuse(target(prefix[None, :-2], output_hidden_states=True).hidden_states)  # up to the anchor
        out = draft(prefix[None, 1:-1], features=g, cache=cache, n_logits=1)  # ends at the anchor: predicts X_{i-1}
        out = draft(prefix[None, -1:], hidden=out.hidden[:, -1:], cache=cache)  # reads X_{i-1}: draws at X_i's place
        torch.testing.assert_close(out.hidden[0, -1], plain.hidden(0, 2, i, i + 1)[0], atol=1e-4, rtol=1e-4)
        fed = draft(depth_ids[i, 1].reshape(1, 1), hidden=out.hidden[:, -1:], cache=cache)
    row = int(valid[:i].sum()) + int(valid[i, :1].sum())  # row-major (position, depth): (i, depth 2)
    torch.testing.assert_close(feats[0][row], fed.hidden[0, 0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(feats[0][row], plain.hidden(0, 3, i + 1, i + 2)[0], atol=1e-3) if i + 1 < n else True
    assert len(labels[0]) == int(valid.sum())
    # decoding with it: the target's greedy tokens
    decoder = SpeculativeDecoder(draft, target, SpecDecPP(head, 0.5, max_candidates=3), SamplingConfig(temperature=0))
    prompt = torch.tensor([[5, 9, 13, 2, 7]])
    assert decoder.generate(prompt, max_new_tokens=12).tokens.tolist() == \
        target.generate(prompt, max_new_tokens=12, do_sample=False).tolist()
    # the potential tool: the head's P_hat by depth from those features, replayed with the paper's lag
    (preds,) = potential.heads_predictions([result["out"]], raw, meta)
    with torch.no_grad():
        np.testing.assert_allclose(preds[0][~np.isnan(preds[0])], torch.sigmoid(head(feats[0])).double().numpy(),
                                   rtol=1e-5)
    config = potential.PotentialConfig(split="dev", seeds=2, max_k=3, thresholds=(0.5,), svip_thresholds=(0.3,),
                                       n_boot=20, quiet=True, cost_ratio=0.1)
    potential.run(str(data), config, heads=[result["out"]], out=str(tmp_path / "pot"))
    records = json.loads((tmp_path / "pot" / "potential.json").read_text())["records"]
    assert any(rec["name"].startswith("head:") for rec in records)


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
