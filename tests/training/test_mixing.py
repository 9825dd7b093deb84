"""The token mixing of the paper's training (specdecpp.training.mixing): the mask, the mixed sequence and
its labels, the draft's features at each candidate."""

from __future__ import annotations

import math

import pytest
import torch

from specdecpp.training.mixing import mixed_example, mixed_features, mixing_mask
from tests.helpers.train import random_rows


def test_mixing_mask_fraction_and_determinism():
    masks = [mixing_mask(500, 0.15, seed=3, epoch=0, row=j) for j in range(40)]
    fraction = torch.cat(masks).float().mean().item()
    assert abs(fraction - 0.15) < 4 * math.sqrt(0.15 * 0.85 / 20000)  # 4 sigma
    assert torch.equal(masks[5], mixing_mask(500, 0.15, seed=3, epoch=0, row=5))
    assert not torch.equal(masks[5], mixing_mask(500, 0.15, seed=3, epoch=1, row=5))
    assert not torch.equal(masks[5], masks[6])
    assert not mixing_mask(50, 0.0, 0, 0, 0).any()
    with pytest.raises(ValueError, match="mixing ratio"):
        mixing_mask(5, 1.0, 0, 0, 0)


def test_mixed_example_positions_and_labels():
    prompt, x, y = [7, 8, 9], [10, 11, 12, 13], [20, 11, 22, 23]
    p = [0.1, 1.0, 0.3, 0.4]
    take_target = torch.tensor([True, False, True, False])
    ids, positions, labels = mixed_example(prompt, x, y, p, take_target)
    assert ids.tolist() == [7, 8, 9, 10, 11, 12, 23]  # Z = X, Y, X, Y
    # loss where Z_i comes from Y (i = 2, 4): hidden output at token Z_i, index len(prompt) + i - 1
    assert positions.tolist() == [4, 6]
    assert ids[positions].tolist() == [11, 23]
    assert labels.tolist() == pytest.approx([1.0, 0.4])


def test_draft_features_are_the_engines_hidden_state_at_each_candidate(draft):
    """e_i fed to the head = final hidden state after reading x, Z_1..Z_i (what the engine passes)."""
    rows = [{"row": j, **{k: torch.tensor(v[j]) for k, v in random_rows(3, 320, 9).items()
                          if k in ("prompt_ids", "target_ids", "draft_ids", "p_acc")}} for j in range(3)]
    hidden, labels = mixed_features(draft, rows, ratio=0.3, seed=1, epoch=0)
    for r, h in zip(rows, hidden, strict=True):
        ids, positions, _ = mixed_example(r["prompt_ids"], r["target_ids"], r["draft_ids"], r["p_acc"],
                                          mixing_mask(len(r["target_ids"]), 0.3, 1, 0, r["row"]))
        assert h.shape == (len(positions), 32)
        for k, pos in enumerate(positions.tolist()):
            alone = draft(ids[None, : pos + 1], output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(h[k], alone, atol=1e-5, rtol=1e-4)
