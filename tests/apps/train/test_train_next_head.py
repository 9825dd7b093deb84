"""train with head=next (the lag-free head): it learns labels that depend on q, its target-context
features are the states that drew each candidate, and training in the target context is recorded
(and refused for the paper's head)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from specdecpp import NextTokenHead, load_head
from specdecpp.models.loading import load_model
from specdecpp.stopping.head import ALL_NEXT_FEATURES, next_token_features
from specdecpp.training.mixing import mixed_features, mixing_mask
from tests.helpers.train import base_overrides, random_rows, save_dataset, train_cfg
from train import run
from train.cache import feature_cache


def test_train_head_next_learns_labels_that_depend_on_q(tiny_pair, tmp_path):
    """``head=next``: labels P_i = sigmoid(3 z(log q(Y_i | Z_<i))) under the fixed mixing, which the
    lag-free head sees as a feature and the paper's head (state at Y_i) does not; the trained head
    ranks them well and saves its kind."""
    draft = load_model(tiny_pair.draft, "cpu")
    splits = {"train": random_rows(48, tiny_pair.vocab, 21), "dev": random_rows(16, tiny_pair.vocab, 22)}
    spec = NextTokenHead(32).feature_spec()
    for rows in splits.values():
        batch = [{"row": j, **{c: torch.tensor(rows[c][j]) for c in ("prompt_ids", "target_ids", "draft_ids", "p_acc")}}
                 for j in range(len(rows["id"]))]
        feats, _ = mixed_features(draft, batch, 0.15, 0, 0, spec)
        logq = torch.cat(feats)[:, 65]  # hidden (32), embedding (32), prob, logprob, entropy
        mean, std = logq.mean(), logq.std()
        for j, f in enumerate(feats):
            keep = (~mixing_mask(len(rows["target_ids"][j]), 0.15, 0, 0, j)).nonzero().squeeze(-1)
            labels = torch.tensor(rows["p_acc"][j])
            labels[keep] = torch.sigmoid(3.0 * (f[:, 65] - mean) / std)
            rows["p_acc"][j] = labels.tolist()
    data = save_dataset(tmp_path / "data", splits, tiny_pair.draft, 32, tiny_pair.vocab)
    cfg = train_cfg([*base_overrides(tiny_pair, data, tmp_path, "callbacks=none", "trainer=cpu"),
                     "head=next", "+experiment=wrej1_d1", "trainer.max_epochs=20", "data.batch_size=8",
                     "optimizer.lr=0.01"])
    assert cfg.experiment_name == "next_wrej1_d1"
    result = run(cfg)
    assert result["metrics"]["dev"]["AUROC"] > 0.8, result["metrics"]["dev"]
    assert result["metrics"]["dev"]["KL"] < 0.5 * result["metrics"]["dev"]["KL_const"]
    head = load_head(cfg.out)
    assert isinstance(head, NextTokenHead) and head.depth == 1 and head.temperature == 1.0
    assert json.loads((Path(cfg.out) / "config.json").read_text())["training"]["head_kind"] == "next"


def test_target_context_features_are_the_states_that_drew_each_candidate(tiny_pair, tmp_path):
    """``data.feature_context=target``: position i's feature comes from the draft's own forward
    over x, X_<i (recomputed here one prefix at a time) and the candidate Y_i, every position
    carries a loss, raw and cached features agree, and the paper's head is refused."""
    draft = load_model(tiny_pair.draft, "cpu")
    rows = random_rows(3, tiny_pair.vocab, 5)
    batch = [{"row": j, **{c: torch.tensor(rows[c][j]) for c in ("prompt_ids", "target_ids", "draft_ids", "p_acc")}}
             for j in range(3)]
    spec = {**NextTokenHead(32, features=ALL_NEXT_FEATURES, top_m=4).feature_spec(), "context": "target"}
    feats, labels = mixed_features(draft, batch, 0.15, 0, 0, spec)
    emb = draft.get_input_embeddings()
    for r, f, lab in zip(batch, feats, labels, strict=True):
        n = len(r["target_ids"])
        assert f.shape[0] == n and torch.equal(lab, r["p_acc"].float())
        for i in range(n):
            ids = torch.cat([r["prompt_ids"], r["target_ids"][:i]])[None]
            with torch.no_grad():
                out = draft(ids, output_hidden_states=True)
            expected = next_token_features(out.hidden_states[-1][0, -1], out.logits[0, -1], r["draft_ids"][i], emb,
                                           1.0, ALL_NEXT_FEATURES, top_m=4, positions=torch.tensor(i))
            torch.testing.assert_close(f[i], expected, atol=1e-4, rtol=1e-4)
    split = Dataset.from_dict({c: rows[c] for c in ("prompt_ids", "target_ids", "draft_ids", "p_acc")})
    cache = feature_cache(split, "train", draft, tiny_pair.draft, tmp_path, 0.15, 0, spec=spec,
                          feature_size=f.shape[1])
    for j in range(3):
        cached, cached_labels = cache.row(j)
        torch.testing.assert_close(cached, feats[j], atol=1e-5, rtol=1e-5)
        assert torch.equal(cached_labels, labels[j])
    with pytest.raises(ValueError, match="feature_context=target needs the lag-free head"):
        mixed_features(draft, batch, 0.15, 0, 0, {"kind": "resnet", "context": "target"})
    with pytest.raises(ValueError, match="feature_context must be one of"):
        mixed_features(draft, batch, 0.15, 0, 0, {**spec, "context": "nonsense"})


def test_train_in_the_target_context_records_it_and_refuses_the_paper_head(tiny_pair, tmp_path):
    draft = load_model(tiny_pair.draft, "cpu")
    splits = {"train": random_rows(24, tiny_pair.vocab, 31), "dev": random_rows(8, tiny_pair.vocab, 32)}
    data = save_dataset(tmp_path / "data", splits, tiny_pair.draft, 32, tiny_pair.vocab)
    common = [*base_overrides(tiny_pair, data, tmp_path, "callbacks=none", "trainer=cpu"), "trainer.max_epochs=1",
              "data.feature_context=target"]
    with pytest.raises(ValueError, match="needs the lag-free head"):
        run(train_cfg([*common, "+experiment=wrej1_d1"]))
    result = run(train_cfg([*common, "head=next", "+experiment=wrej1_d1"]))
    config = json.loads((Path(result["out"]) / "config.json").read_text())
    assert config["training"]["feature_context"] == "target"
    n_tokens = sum(len(t) for t in splits["dev"]["target_ids"])
    assert result["metrics"]["dev"]["positions"] == n_tokens  # every position, not only the mixing's Y-positions
    del draft
