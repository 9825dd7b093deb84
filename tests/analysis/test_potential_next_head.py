"""The potential analysis with lag-free heads: scored in the target context, lag 0 is the lag-free
rule, heads of the same name told apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdecpp.analysis import potential as pt
from specdecpp.models.loading import load_model
from tests.helpers.tiny import random_next_head
from tests.helpers.train import random_rows


def test_potential_scores_lag_free_heads_in_the_target_context(tiny_pair, tmp_path):
    """``infer.potential --head-context target``: a lag-free head's P_hat at position i is the head
    applied to the features of the draft's forward over x, X_<i (recomputed prefix by prefix)."""
    from infer.potential import heads_predictions

    draft = load_model(tiny_pair.draft, "cpu")
    head = random_next_head(32, 1, seed=4)
    head.save_pretrained(tmp_path / "h")
    rows = random_rows(2, tiny_pair.vocab, 9)
    raw = [{"row": j, **{c: rows[c][j] for c in ("prompt_ids", "target_ids", "draft_ids", "p_acc")}} for j in range(2)]
    (preds,) = heads_predictions([str(tmp_path / "h")], raw, {"draft": tiny_pair.draft}, context="target")
    head.attach(draft)
    for r, p in zip(raw, preds, strict=True):
        for i in range(len(r["target_ids"])):
            with torch.no_grad():
                out = draft(torch.tensor([r["prompt_ids"] + r["target_ids"][:i]]), output_hidden_states=True)
                expected = torch.sigmoid(head.score(out.hidden_states[-1][0, -1], out.logits[0, -1],
                                                    torch.tensor(r["draft_ids"][i])))
            assert abs(p[i] - float(expected)) < 1e-4
    with pytest.raises(ValueError, match="head-context"):
        heads_predictions([str(tmp_path / "h")], raw, {"draft": tiny_pair.draft}, context="elsewhere")


def test_potential_head_rule_with_lag_zero_is_the_lag_free_rule():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(6):
        p = rng.random(40)
        rows.append({"p_acc": p, "draft_entropy": rng.random(40), "pred:free": p.copy(), "pred:paper": p.copy()})
    pols = [pt.informed_lag_free(0.4), pt.head_rule("free", 0.4, lag=0), pt.informed(0.4), pt.head_rule("paper", 0.4)]
    res = pt.simulate(rows, pols, seeds=range(3))
    records = pt.summarise(res, pols, pt.Costs.from_ratio(0.1), n_boot=50)
    vals = [(r["verification_rate"], r["discard_rate"]) for r in records]
    assert vals[0] == pytest.approx(vals[1]) and vals[2] == pytest.approx(vals[3])
    assert vals[0][0] != pytest.approx(vals[2][0])  # the lag changes the rounds


def test_potential_tells_heads_of_the_same_name_apart(tmp_path):
    from infer.potential import head_labels

    a, b, c = tmp_path / "x" / "next_wrej1_d1", tmp_path / "y" / "next_wrej1_d1", tmp_path / "y" / "wrej1_d0"
    assert head_labels([a, b, c]) == ["x/next_wrej1_d1", "y/next_wrej1_d1", "wrej1_d0"]
    assert head_labels([c]) == ["wrej1_d0"]
    with pytest.raises(ValueError, match="twice"):
        head_labels([a, a])
