"""Issue 64 rows 5-7 through ``specdecpp.hf.generate`` (transformers' ``generate(custom_generate=...)``
with ``head="dir"``): a broken head is the one loader's error, naming the directory, the file and
the key or the problem (tests/stopping/test_head_files.py has the loader's own)."""

from __future__ import annotations

import functools

import pytest

import specdecpp.hf as hf
from specdecpp.models.loading import load_model
from tests.helpers.heads import DROP, broken_head


@pytest.fixture(scope="module")
def models(tiny_pair):
    return load_model(tiny_pair.target, "cpu", "float32"), load_model(tiny_pair.draft, "cpu", "float32")


@pytest.mark.parametrize("broken, match", [
    ({"hidden_size": DROP}, "{cfg} has no 'hidden_size' (a head's config records hidden_size, depth and kind)"),
    ({"depth": "three"}, "{cfg} has 'depth': \"three\", which must be an integer >= 0"),
    ({"cut": True}, "{weights} ({size} bytes) cannot be read as safetensors (SafetensorError: "),
], ids=["no_hidden_size", "depth_three", "cut_weights"])
def test_hf_generate_names_the_broken_head(tiny_pair, models, tmp_path, broken, match):
    target, draft = models
    head = broken_head(tmp_path / "head", tiny_pair.draft_hidden, "next", draft=tiny_pair.draft, **broken)
    weights = head / "model.safetensors"
    ids = tiny_pair.tokenizer("The quick brown", return_tensors="pt").input_ids
    with pytest.raises(ValueError) as err:
        target.generate(ids, max_new_tokens=3, do_sample=False,
                        custom_generate=functools.partial(hf.generate, draft_model=draft, head=str(head)))
    expected = match.format(cfg=head / "config.json", weights=weights, size=weights.stat().st_size)
    assert str(err.value).startswith(f"acceptance head {str(head)!r}: {expected}")
