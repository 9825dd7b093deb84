"""Issue 64 rows 5-7 through the applications: ``python -m infer`` (method.head) and
``infer.potential --head`` load a broken head through the one loader and fail with its message
(the directory, config.json and the key; model.safetensors and the problem) before any model loads.
The loader's own tests: tests/stopping/test_head_files.py."""

from __future__ import annotations

import pytest

import infer.app as app
from infer import potential
from tests.helpers.heads import DROP, broken_head
from tests.helpers.infer import make_cfg


@pytest.fixture
def infer_base(tiny_pair, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "sea", "prompt": "Write a short poem about the sea."}\n')
    app._LOADED.clear()

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the head was checked")

    monkeypatch.setattr(app, "load_pair", refuse)
    return [f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "prompts=jsonl",
            f"prompts.path={prompts}", "max_new_tokens=2", "warmup_tokens=0", "progress=false", f"out={tmp_path}/out",
            "method=specdecpp", "sampling=greedy"]


@pytest.mark.parametrize("broken, match", [
    ({"hidden_size": DROP}, "{cfg} has no 'hidden_size' (a head's config records hidden_size, depth and kind)"),
    ({"depth": DROP}, "{cfg} has no 'depth'"),
    ({"depth": "three"}, "{cfg} has 'depth': \"three\", which must be an integer >= 0"),
    ({"cut": True}, "{weights} ({size} bytes) cannot be read as safetensors (SafetensorError: "),
], ids=["no_hidden_size", "no_depth", "depth_three", "cut_weights"])
def test_infer_names_the_broken_head(tiny_pair, tmp_path, infer_base, broken, match):
    head = broken_head(tmp_path / "head", tiny_pair.draft_hidden, draft=tiny_pair.draft, **broken)
    weights = head / "model.safetensors"
    with pytest.raises(ValueError) as err:
        app.run(make_cfg(*infer_base, f"method.head={head}"))
    expected = match.format(cfg=head / "config.json", weights=weights, size=weights.stat().st_size)
    assert str(err.value).startswith(f"acceptance head {str(head)!r}: {expected}")


@pytest.mark.parametrize("broken, match", [
    ({"hidden_size": DROP}, "{cfg} has no 'hidden_size'"),
    ({"cut": True}, "{weights} ({size} bytes) cannot be read as safetensors (SafetensorError: "),
], ids=["no_hidden_size", "cut_weights"])
def test_potential_names_the_broken_head(tiny_pair, tiny_dataset, tmp_path, broken, match, capsys):
    head = broken_head(tmp_path / "head", tiny_pair.draft_hidden, draft=tiny_pair.draft, **broken)
    weights = head / "model.safetensors"
    expected = match.format(cfg=head / "config.json", weights=weights, size=weights.stat().st_size)
    with pytest.raises(SystemExit) as err:
        potential.main([str(tiny_dataset), "--cost-ratio", "0.1", "--head", str(head), "--seeds", "1",
                        "--out", str(tmp_path / "pot")])
    assert str(err.value.code).startswith(f"infer.potential: acceptance head {str(head)!r}: {expected}")
    assert not (tmp_path / "pot").exists()
