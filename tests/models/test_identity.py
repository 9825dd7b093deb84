"""Portable records: heads and datasets name models by identities that resolve on any machine
(specdecpp.models.identity), and the library knows nothing of the demo or the applications."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys

import pytest

from specdecpp import AcceptanceHead, load_head, load_pair, register_resolver
from specdecpp.models.identity import (
    IDENTITY_FILE,
    model_identity,
    model_key,
    parse_identity,
    portable_name,
    same_model,
    unregister_resolver,
    write_identity,
)
from specdecpp.models.loading import load_config
from tests.helpers.paths import REPO


@pytest.fixture
def stamped_draft(tmp_path, tiny_pair):
    """A copy of the tiny draft stamped with an identity, and a resolver for its name."""
    directory = tmp_path / "machine_a" / "draft"
    shutil.copytree(tiny_pair.draft, directory)
    digest = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    identity = f"tiny-draft@{digest}"
    write_identity(directory, identity)
    calls = []

    def resolver(ident: str):
        calls.append(ident)
        if ident != identity:
            raise LookupError(f"only {identity} is known")
        return directory

    register_resolver("tiny-draft", resolver)
    yield directory, identity, calls
    unregister_resolver("tiny-draft")


def test_a_saved_head_records_the_identity_and_loads_back_through_the_resolver(tmp_path, tiny_pair, stamped_draft):
    directory, identity, calls = stamped_draft
    head = AcceptanceHead(32, 1, draft=str(directory))
    head.save_pretrained(tmp_path / "head", target=str(tiny_pair.target),
                         training={"dataset_meta": {"draft": str(directory), "target": "org/model"}})
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["draft"] == identity  # not machine_a's path
    assert config["training"]["dataset_meta"] == {"draft": identity, "target": "org/model"}
    assert config["target"] == str(tiny_pair.target)  # an unstamped local directory has no portable name

    loaded = load_head(tmp_path / "head")
    assert loaded.draft == identity and calls == []
    draft, target, _ = load_pair(loaded.draft, str(tiny_pair.target), device="cpu")
    assert set(calls) == {identity} and draft.config.hidden_size == 32
    assert same_model(loaded.draft, str(directory)) and same_model(str(directory), loaded.draft)
    assert not same_model(loaded.draft, str(tiny_pair.draft))  # the unstamped original is another reference
    assert load_config(identity).hidden_size == 32


def test_an_unresolvable_identity_names_what_to_pass(tiny_pair):
    with pytest.raises(FileNotFoundError, match=r"no resolver for 'nobody-draft'.*pair\.draft=PATH"):
        load_pair("nobody-draft@0123abcd", str(tiny_pair.target), device="cpu")


def test_a_resolver_that_cannot_provide_the_digest_says_why(stamped_draft, tiny_pair):
    _, identity, _ = stamped_draft
    other = identity[:-4] + "0000"
    with pytest.raises(FileNotFoundError, match=r"cannot provide it: only tiny-draft@.*pair\.draft=PATH"):
        load_pair(other, str(tiny_pair.target), device="cpu")


def test_a_resolver_must_return_the_model_asked_for(tmp_path, tiny_pair):
    register_resolver("liar", lambda ident: tiny_pair.draft)  # an unstamped directory
    try:
        with pytest.raises(FileNotFoundError, match="not the model asked for"):
            load_config("liar@abcdef01")
    finally:
        unregister_resolver("liar")


def test_identity_parsing_and_portable_names(tmp_path, tiny_pair):
    assert parse_identity("my-draft@3f2a") == ("my-draft", "3f2a")
    for not_identity in ("org/model", "/abs/path", "plain-name", "a@b/c"):
        assert parse_identity(not_identity) is None
    assert portable_name("org/model") == "org/model" and portable_name(None) is None
    assert model_identity(tiny_pair.draft) is None
    with pytest.raises(ValueError, match="name@digest"):
        write_identity(tmp_path, "no-digest")
    with pytest.raises(ValueError, match="without '@'"):
        register_resolver("bad@name", lambda ident: None)
    (tmp_path / IDENTITY_FILE).write_text("not json")
    assert model_identity(tmp_path) is None  # a broken stamp is no identity


def test_model_key_names_a_model_once_however_it_is_referred_to(tmp_path, monkeypatch):
    """model_key groups as same_model compares: relative, absolute, linked and slashed paths to one
    directory give one key; a stamped directory gives its identity; other directories and hub ids differ."""
    (tmp_path / "m").mkdir()
    (tmp_path / "n").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    spellings = ["m", "m/", str(tmp_path / "m"), "link", "./m"]
    assert len({model_key(s) for s in spellings}) == 1
    assert all(same_model(a, b) for a in spellings for b in spellings)
    assert model_key("n") != model_key("m") and not same_model("n", "m")
    assert model_key("org/model") == model_key("org/model/") == "org/model"
    write_identity(tmp_path / "n", "my-draft@3f2a")
    assert model_key("n") == model_key("my-draft@3f2a") == "my-draft@3f2a"


def test_shipped_heads_record_no_local_path():
    """Every model a shipped head names is a portable identity; no string in any config.json is an
    absolute path or a path into a cache."""
    configs = sorted((REPO / "demo" / "heads").glob("*/config.json"))
    assert len(configs) >= 22

    def strings(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    for path in configs:
        config = json.loads(path.read_text())
        for key, value in (("draft", config["draft"]), ("target", config["target"]),
                           ("dataset_meta.draft", config["training"]["dataset_meta"]["draft"]),
                           ("dataset_meta.target", config["training"]["dataset_meta"]["target"])):
            assert parse_identity(value) is not None, f"{path}: {key} is {value!r}, not a portable identity"
        bad = [s for s in strings(config) if s.startswith(("/", "~")) or ".cache" in s or re.match(r"^[A-Za-z]:\\", s)]
        assert not bad, f"{path} records local paths: {bad}"


def test_the_library_source_names_nothing_of_the_demo():
    """The demo is an application of specdecpp (specdecpp_demo/): the library names none of its
    files, paths, stamps, models or packages."""
    pattern = re.compile(r"demo|smollm|\.cache/|REPO_ROOT", re.IGNORECASE)
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
            for p in sorted((REPO / "specdecpp").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)


def test_importing_the_library_imports_no_application():
    """Every specdecpp module imported in a fresh interpreter pulls in none of the apps, the demo,
    Hydra or Lightning."""
    code = ("import importlib, pkgutil, sys, specdecpp\n"
            "for m in pkgutil.walk_packages(specdecpp.__path__, 'specdecpp.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted({n.split('.')[0] for n in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    roots = set(json.loads(out.stdout.strip().replace("'", '"')))
    assert "specdecpp" in roots
    forbidden = {"data_gen", "train", "infer", "specdecpp_demo", "demo", "hydra", "omegaconf", "lightning",
                 "pytorch_lightning"}
    assert not roots & forbidden, f"the library imported {sorted(roots & forbidden)}"
