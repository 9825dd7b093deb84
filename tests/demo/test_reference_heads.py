"""specdecpp_demo.reference_heads for the feature pair (``--pair demo_feature``): the paper's head is
refused before anything runs, and the Table 3 trends table reads the sweep's selection and dev KLs."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from specdecpp_demo import reference_heads


def test_the_paper_head_on_the_feature_pair_is_refused_before_anything_runs(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(reference_heads, "run", lambda cmd: ran.append(cmd))
    monkeypatch.setattr(sys, "argv", ["reference_heads", "--pair", "demo_feature", "--kind", "resnet"])
    with pytest.raises(SystemExit) as exc:
        reference_heads.main()
    assert exc.value.code == 2 and not ran
    assert "lag-free heads only" in capsys.readouterr().err


def test_the_feature_pair_gets_its_own_data_heads_and_context(monkeypatch):
    ran = []
    monkeypatch.setattr(reference_heads, "run", lambda cmd: ran.append(cmd))
    monkeypatch.setattr(sys, "argv", ["reference_heads", "--pair", "demo_feature", "--stage", "data"])
    reference_heads.main()
    (cmd,) = ran
    assert "pair=demo_feature" in cmd and "out=data/demo_feature/reference" in cmd
    args = SimpleNamespace(pair="demo_feature", heads="heads/reference", heads_next="heads/reference_feature_next")
    assert reference_heads.kinds(args) == ["next"]
    assert reference_heads.shipped_dir(args).name == "heads_feature"


def test_table3_reads_best_thresholds_and_dev_kl(tmp_path):
    args = SimpleNamespace(pair="demo_feature", heads="unused", heads_next=str(tmp_path), data="data/x")
    ranking = []
    for w in (1, 3, 6, 12):
        for d in range(5):
            name = f"wrej{w}_d{d}"
            (tmp_path / f"next_{name}").mkdir()
            (tmp_path / f"next_{name}" / "config.json").write_text(
                json.dumps({"metrics": {"dev": {"KL": 0.5 - 0.01 * d}}}))
            ranking.append({"name": f"next_{name}", "kind": "next", "best_threshold": 0.9 - 0.1 * (w > 3),
                            "best_speedup": 1.2})
    text = reference_heads.table3(args, {"ranking": ranking})
    assert "| 1 | 0.9 (1.200x) / 0.5000 |" in text
    assert "Mean best threshold by w_rej: 1: 0.90, 3: 0.90, 6: 0.80, 12: 0.80" in text
    assert "d=4: 0.4600" in text
