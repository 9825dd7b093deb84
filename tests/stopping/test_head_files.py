"""Issue 64 rows 5-7: a saved head whose config.json lacks a key or holds one of the wrong type, or
whose model.safetensors is cut short, is one ValueError from the one loader
(``specdecpp.stopping.head.read_head_config`` and ``load_head``), naming the head directory, the
file and the key or the problem (they were a bare KeyError, ``int()``'s ValueError and safetensors'
"incomplete metadata"). The entries that load heads through it: tests/apps/infer/test_infer_head_files.py,
tests/hf/test_hf_head_files.py."""

from __future__ import annotations

import pytest

from specdecpp import AcceptanceHead, NextTokenHead, load_head
from specdecpp.stopping.head import head_kind
from tests.helpers.heads import DROP, broken_head

RESAVE = "re-save the head with save_pretrained, or train it again (python -m train +experiment=...)"


@pytest.mark.parametrize("kind", ["resnet", "next"])
@pytest.mark.parametrize("key", ["hidden_size", "depth"])
def test_missing_config_key_names_the_directory_file_and_key(tmp_path, kind, key):
    head = broken_head(tmp_path / "h", 16, kind, **{key: DROP})
    with pytest.raises(ValueError) as err:
        load_head(head)
    assert str(err.value) == (f"acceptance head {str(head)!r}: {head / 'config.json'} has no {key!r} (a head's config "
                              f"records hidden_size, depth and kind); add it, or {RESAVE}")
    with pytest.raises(ValueError, match=f"has no '{key}'"):  # the class's own loader is the same one
        (AcceptanceHead if kind == "resnet" else NextTokenHead).from_pretrained(head)


def test_config_without_kind_is_the_papers_head(tmp_path):
    head = broken_head(tmp_path / "h", 16, "resnet", kind=DROP)  # heads saved before head kinds existed
    assert type(load_head(head)) is AcceptanceHead and head_kind(head) == "resnet"


@pytest.mark.parametrize("key, value, want", [
    ("depth", "three", "an integer >= 0"),
    ("depth", -1, "an integer >= 0"),
    ("hidden_size", 16.5, "a positive integer"),
    ("hidden_size", True, "a positive integer"),
    ("kind", "tree", "one of ['resnet', 'next']"),
])
def test_config_value_of_the_wrong_type_names_the_key_and_value(tmp_path, key, value, want):
    head = broken_head(tmp_path / "h", 16, **{key: value})
    for load in (load_head, head_kind):
        with pytest.raises(ValueError) as err:
            load(head)
        shown = '"three"' if value == "three" else '"tree"' if value == "tree" else str(value).lower()
        assert str(err.value) == (f"acceptance head {str(head)!r}: {head / 'config.json'} has {key!r}: {shown}, "
                                  f"which must be {want}; fix it, or {RESAVE}")


def test_bad_kind_settings_and_invalid_json_name_the_file(tmp_path):
    head = broken_head(tmp_path / "h", 16, "next", top_m="many", features=["topm"])
    with pytest.raises(ValueError, match=rf"^acceptance head '{head}': {head / 'config.json'} does not describe a "
                                         r"'next' head \(invalid literal for int\(\)"):
        load_head(head)
    (head / "config.json").write_text('{"hidden_size": 16, "depth"')
    with pytest.raises(ValueError, match=rf"^acceptance head '{head}': {head / 'config.json'} is not valid JSON"):
        load_head(head)


@pytest.mark.parametrize("kind", ["resnet", "next"])
def test_truncated_weights_name_the_file_and_the_problem(tmp_path, kind):
    head = broken_head(tmp_path / "h", 16, kind, cut=True)
    weights = head / "model.safetensors"
    with pytest.raises(ValueError) as err:
        load_head(head)
    message = str(err.value)
    assert message.startswith(f"acceptance head {str(head)!r}: {weights} ({weights.stat().st_size} bytes) cannot "
                              "be read as safetensors (SafetensorError: ")
    assert message.endswith("the file is cut short or corrupt: copy it again from where the head was saved, "
                            f"or {RESAVE}")


def test_weights_of_other_sizes_than_the_config_name_both_files(tmp_path):
    head = broken_head(tmp_path / "h", 16, hidden_size=24)  # weights of a 16-wide head, a config of 24
    with pytest.raises(ValueError, match=rf"^acceptance head '{head}': the weights in {head / 'model.safetensors'} do "
                                         rf"not fit {head / 'config.json'} \(hidden_size=24, depth=1\): "
                                         r"blocks.0.linear.bias is \(16,\), not \(24,\); "
                                         r"blocks.0.linear.weight is \(16, 16\), not \(24, 24\); "):
        load_head(head)
