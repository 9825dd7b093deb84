import json
import math

import pytest
import torch

from specdecpp import SVIP, AcceptanceHead, FixedK, SpecDecPP, TargetOnly
from specdecpp.core.sampling import entropy


def test_head_blocks_are_distinct_and_shaped_as_designed():
    head = AcceptanceHead(16, depth=3)
    assert len(head.blocks) == 3
    ids = {id(b.linear.weight) for b in head.blocks}
    assert len(ids) == 3
    w = [b.linear.weight for b in head.blocks]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
    assert sum(p.numel() for p in head.parameters()) == 3 * (16 * 16 + 16) + 16 + 1
    x = torch.randn(5, 16)
    manual = x
    for b in head.blocks:  # x + SiLU(Linear(x)), then Linear(hidden, 1)
        manual = manual + torch.nn.functional.silu(b.linear(manual))
    torch.testing.assert_close(head(x), head.out(manual).squeeze(-1))
    assert AcceptanceHead(16, depth=0)(x).shape == (5,)


def test_head_save_load_round_trip(tmp_path):
    head = AcceptanceHead(24, depth=2, draft="my/draft")
    head.save_pretrained(tmp_path / "h", training={"w_rej": 6}, metrics={"val/KL": 0.5})
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["hidden_size"] == 24 and config["depth"] == 2 and config["draft"] == "my/draft"
    assert config["training"] == {"w_rej": 6} and config["metrics"] == {"val/KL": 0.5}
    assert (tmp_path / "h" / "model.safetensors").is_file()
    loaded = AcceptanceHead.from_pretrained(tmp_path / "h")
    x = torch.randn(3, 24)
    torch.testing.assert_close(loaded(x), head(x))
    assert loaded.draft == "my/draft" and loaded.meta["training"] == {"w_rej": 6}


def test_head_missing_path_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AcceptanceHead.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        AcceptanceHead.from_pretrained(tmp_path / "empty")


def test_head_hidden_size_mismatch():
    head = AcceptanceHead(8, 1)
    with pytest.raises(ValueError, match="size 8"):
        head(torch.randn(2, 12))


@pytest.mark.parametrize("make", [
    lambda: SpecDecPP(AcceptanceHead(4, 0), threshold=1.5),
    lambda: SpecDecPP(AcceptanceHead(4, 0), threshold=-0.1),
    lambda: SpecDecPP(AcceptanceHead(4, 0), threshold=float("nan")),
    lambda: SVIP(threshold=2.0),
])
def test_threshold_outside_unit_interval_is_refused(make):
    with pytest.raises(ValueError, match="threshold must be a number in \\[0, 1\\]"):
        make()


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), True, "0.5", 0, 2.5])
def test_policies_and_infer_configs_share_one_settings_check(bad):
    """The library and `python -m infer` accept and refuse the same values, with the same words
    (a bool threshold or count used to pass the library and fail the config check)."""
    from infer.methods import resolve_method
    from specdecpp import SamplingConfig

    def outcome(make):
        try:
            make()
        except ValueError as exc:
            return str(exc).split(": ", 1)[1].replace("method.", "")
        return "accepted"

    library = [outcome(lambda: SVIP(threshold=bad)), outcome(lambda: SVIP(max_candidates=bad)),
               outcome(lambda: FixedK(bad))]
    svip = {"name": "svip", "threshold": 0.3, "c": 0.15, "max_candidates": 40}
    config = [outcome(lambda: resolve_method({**svip, "threshold": bad}, "d", SamplingConfig())),
              outcome(lambda: resolve_method({**svip, "max_candidates": bad}, "d", SamplingConfig())),
              outcome(lambda: resolve_method({"name": "fixed_k", "k": bad}, "d", SamplingConfig()))]
    assert library == config
    assert library[0] != "accepted" or isinstance(bad, (int, float)) and 0 <= bad <= 1 and bad is not True


def test_one_same_model_rule_for_train_and_infer(tmp_path):
    """A dataset's draft and a head's draft are matched against pair.draft by one rule."""
    from specdecpp.models.fit import check_draft_fit  # infer's check of a head
    from train.checks import check_draft_matches

    (tmp_path / "draft").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "draft")
    for a, b, same in ((f"{tmp_path}/draft/", str(tmp_path / "link"), True), ("org/model/", "org/model", True),
                       ("org/model", "org/other", False)):
        for check in (lambda a=a, b=b: check_draft_fit("method.head 'H'", "head", a, 32, b, 32,
                                                       "method.allow_draft_mismatch"),
                      lambda a=a, b=b: check_draft_matches({"draft": a}, b, 32, "DIR", allow_mismatch=False)):
            if same:
                check()
            else:
                with pytest.raises(ValueError, match="does not match the configured draft"):
                    check()


@pytest.mark.parametrize("make,match", [
    (lambda: FixedK(0), "k must be"), (lambda: FixedK(2.5), "k must be"),
    (lambda: SVIP(max_candidates=0), "max_candidates"),
    (lambda: SpecDecPP(AcceptanceHead(4, 0), min_candidates=5, max_candidates=3), "min_candidates"),
    (lambda: SpecDecPP("heads/x"), "AcceptanceHead"),
])
def test_bad_policy_settings_are_refused(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_svip_stops_when_sqrt_c_entropy_exceeds_threshold():
    policy = SVIP(threshold=0.3, c=0.15)
    policy.bind(None, temperature=1.0)
    v = 1000
    flat = torch.zeros(v)                      # H = ln(1000) = 6.9 nats: sqrt(0.15 * 6.9) = 1.02 > 0.3
    peaked = torch.full((v,), -30.0)
    peaked[0] = 0.0                            # H ~ 0
    assert policy.should_stop(1, flat, None)
    assert not policy.should_stop(1, peaked, None)
    # exactly at the boundary H = (h^2)/c = 0.6 nats: two-token distribution with entropy 0.6
    boundary = SVIP(threshold=math.sqrt(0.15 * 0.6) + 1e-3)
    boundary.bind(None, 1.0)
    p = 0.2807  # H(p, 1-p) ~= 0.5935 nats, just below 0.6
    two = torch.full((v,), -1e9)
    two[0], two[1] = math.log(p), math.log(1 - p)
    assert not boundary.should_stop(1, two, None)


@pytest.mark.parametrize("vocab,temperature", [(32, 1.0), (50_000, 1.0), (4096, 0.7)])
def test_svip_one_row_decides_as_its_batch_at_the_threshold(vocab, temperature):
    """should_stop (the entropy read on the host, compared in Python floats) and stop_rows (float64
    tensors) agree where it matters most: thresholds a few float64 steps either side of each row's
    sqrt(c * H), against c * H > t ** 2 recomputed here from the row's entropy as a batch."""
    g = torch.Generator().manual_seed(vocab)
    for _ in range(20):
        logits = (torch.randn(vocab, generator=g) * 4).to(torch.bfloat16)
        h = float(entropy(logits.unsqueeze(0), temperature)[0])
        at = math.sqrt(0.15 * h)
        below, above = at, at
        for _ in range(3):
            below, above = math.nextafter(below, 0.0), math.nextafter(above, 1.0)
        for threshold in (below, math.nextafter(at, 0.0), at, math.nextafter(at, 1.0), above):
            policy = SVIP(threshold, c=0.15)
            policy.bind(None, temperature)
            rows = policy.stop_rows(1, logits.unsqueeze(0), None, torch.zeros(1, dtype=torch.long),
                                    torch.ones(1, dtype=torch.bool))
            assert policy.should_stop(1, logits, None) == bool(rows[0]) == (0.15 * h > threshold * threshold)
        decided = []
        for threshold in (below, above):  # three steps off: sqrt(c H)'s side, however it rounds
            policy = SVIP(threshold, c=0.15)
            policy.bind(None, temperature)
            decided.append(policy.should_stop(1, logits, None))
        assert decided == [True, False]


def test_fixed_k_and_target_only():
    assert [FixedK(3).should_stop(k, None, None) for k in (1, 2, 3)] == [False, False, True]
    assert TargetOnly().max_candidates == 0
