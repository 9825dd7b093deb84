"""Round 3's module paths (specdecpp.head, specdecpp.engine, ...) still import, for one release:
each warns, naming the new path and the release that removes it, and gives the new modules' own
objects (specdecpp/_moved.py; docs/api.md, "Moved modules")."""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
import warnings

import pytest
from packaging.version import Version

import specdecpp
from specdecpp import _moved
from tests.helpers.paths import REPO

ROUND3 = "69d836f^"  # the commit before the layout move: round 3's flat specdecpp/*.py
# written out here, not read from specdecpp._moved: round 3's module -> where its names live now
NEW_HOMES = {
    "batch": ["specdecpp.decoders.batch"], "cascade": ["specdecpp.decoders.cascade"],
    "compat": ["specdecpp.core.compat"], "costmodel": ["specdecpp.analysis.costmodel"],
    "dataset": ["specdecpp.data.dataset"], "engine": ["specdecpp.decoders.chain", "specdecpp.decoders.rounds"],
    "head": ["specdecpp.stopping.head"], "head_metrics": ["specdecpp.training.metrics"],
    "hooks": ["specdecpp.core.hooks"], "identity": ["specdecpp.models.identity"],
    "jsonfile": ["specdecpp.core.jsonfile"], "labels": ["specdecpp.data.labels"],
    "loading": ["specdecpp.models.loading"], "loss": ["specdecpp.training.loss"],
    "mixing": ["specdecpp.training.mixing"], "pearl": ["specdecpp.decoders.pearl"],
    "policies": ["specdecpp.stopping.policies"], "potential": ["specdecpp.analysis.potential"],
    "prompts": ["specdecpp.data.prompts"], "quality": ["specdecpp.analysis.quality"],
    "reduced_vocab": ["specdecpp.models.reduced_vocab"],
    "rounds": ["specdecpp.decoders.rounds", "specdecpp.models.runner", "specdecpp.core.timing",
               "specdecpp.core.attention"],
    "sampling": ["specdecpp.core.sampling"], "schedules": ["specdecpp.training.schedules"],
    "sequoia": ["specdecpp.decoders.sequoia"], "stats": ["specdecpp.analysis.stats"],
    "tasks": ["specdecpp.data.tasks"], "timing": ["specdecpp.core.timing"], "tree": ["specdecpp.decoders.tree"],
    "tree_search": ["specdecpp.analysis.tree_search"], "verify": ["specdecpp.core.verify"],
}
# what round 3's README, docs and users (issue 64) imported: (statement, name, the object now)
DOCUMENTED = [
    ("from specdecpp.head import NextTokenHead", "NextTokenHead", "specdecpp.stopping.head:NextTokenHead"),
    ("from specdecpp.head import AcceptanceHead", "AcceptanceHead", "specdecpp.stopping.head:AcceptanceHead"),
    ("from specdecpp.head import load_head", "load_head", "specdecpp.stopping.head:load_head"),
    ("from specdecpp.engine import SpeculativeDecoder", "SpeculativeDecoder",
     "specdecpp.decoders.chain:SpeculativeDecoder"),
    ("from specdecpp.engine import RunStats", "RunStats", "specdecpp.decoders.rounds:RunStats"),
    ("from specdecpp.engine import GenerateOutput", "GenerateOutput", "specdecpp.decoders.rounds:GenerateOutput"),
    ("from specdecpp.policies import SpecDecPP", "SpecDecPP", "specdecpp.stopping.policies:SpecDecPP"),
    ("from specdecpp.prompts import load_prompts", "load_prompts", "specdecpp.data.prompts:load_prompts"),
    ("from specdecpp.prompts import Prompt", "Prompt", "specdecpp.data.prompts:Prompt"),
    ("from specdecpp.prompts import encode_prompt", "encode_prompt", "specdecpp.data.prompts:encode_prompt"),
    ("from specdecpp.dataset import load_labelled", "load_labelled", "specdecpp.data.dataset:load_labelled"),
    ("from specdecpp.identity import write_identity", "write_identity", "specdecpp.models.identity:write_identity"),
    ("from specdecpp.labels import label_responses", "label_responses", "specdecpp.data.labels:label_responses"),
    ("from specdecpp.sampling import warp", "warp", "specdecpp.core.sampling:warp"),
    ("from specdecpp.verify import verify", "verify", "specdecpp.core.verify:verify"),
    ("from specdecpp.rounds import ModelRunner", "ModelRunner", "specdecpp.models.runner:ModelRunner"),
    ("from specdecpp.tasks import humaneval_pass", "humaneval_pass", "specdecpp.data.tasks:humaneval_pass"),
]
# renamed in the move: (module, old name) -> the object now
RENAMED = {("rounds", "Sequence"): "specdecpp.decoders.rounds:TokenBuffer",
           ("tasks", "run_check_subprocess"): "specdecpp.data.tasks:run_check"}


def obj(where: str):
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


@pytest.fixture(autouse=True)
def fresh():
    """Each test imports the old paths afresh (an import warns once per process); afterwards the
    package's attributes are as they were (importing specdecpp.verify rebinds specdecpp.verify)."""
    saved = {old: vars(specdecpp)[old] for old in NEW_HOMES if old in vars(specdecpp)}  # the function verify

    def forget():
        for old in NEW_HOMES:
            sys.modules.pop(f"specdecpp.{old}", None)
            vars(specdecpp).pop(old, None)
        vars(specdecpp).update(saved)
    forget()
    yield
    forget()


def test_the_table_is_the_moved_modules():
    assert {old: list(homes) for old, homes in _moved.MOVED.items()} == NEW_HOMES


@pytest.mark.parametrize("old", sorted(NEW_HOMES))
def test_each_old_path_warns_with_the_new_one_at_the_import(old):
    with pytest.warns(DeprecationWarning) as said:
        module = importlib.import_module(f"specdecpp.{old}")
    (warning,) = [w for w in said if f"specdecpp.{old} is deprecated" in str(w.message)]
    for home in NEW_HOMES[old]:
        assert home in str(warning.message)
    assert _moved.REMOVED_IN in str(warning.message)
    assert sys.modules[f"specdecpp.{old}"] is module
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(f"specdecpp.{old}") is module  # once per process, as any import


def test_the_warning_points_at_the_import_statement():
    with pytest.warns(DeprecationWarning, match=r"specdecpp\.head is deprecated") as said:
        from specdecpp.head import NextTokenHead  # noqa: F401
    assert said[0].filename == __file__


@pytest.mark.parametrize("statement, name, now", DOCUMENTED, ids=[d[0] for d in DOCUMENTED])
def test_round_3s_documented_imports_give_the_same_objects(statement, name, now):
    scope = {}
    with pytest.warns(DeprecationWarning, match="is deprecated: import from"):
        exec(statement, scope)
    assert scope[name] is obj(now)


def test_renamed_names_say_their_new_name():
    for (old, name), now in RENAMED.items():
        with pytest.warns(DeprecationWarning):
            module = importlib.import_module(f"specdecpp.{old}")
        new = now.replace(":", ".")
        with pytest.warns(DeprecationWarning, match=rf"specdecpp\.{old}\.{name} is now {new}"):
            assert getattr(module, name) is obj(now)


def test_a_missing_name_or_module_is_still_an_error():
    with pytest.warns(DeprecationWarning):
        import specdecpp.head as head
    with pytest.raises(ImportError, match="NoSuchHead"):
        exec("from specdecpp.head import NoSuchHead", {})
    with pytest.raises(AttributeError, match="moved to specdecpp.stopping.head"):
        _ = head.NoSuchHead
    with pytest.raises(AttributeError):
        _ = head.__path__  # not a package
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("specdecpp.no_such_module")
    with pytest.raises(ModuleNotFoundError):  # a real module of the new layout wins over the finder
        importlib.import_module("specdecpp.stopping.engine")


def test_star_import_gives_the_new_modules_names():
    scope = {}
    with pytest.warns(DeprecationWarning):
        exec("from specdecpp.policies import *", scope)
    assert scope["SVIP"] is obj("specdecpp.stopping.policies:SVIP")


def test_the_package_function_verify_stays_callable(monkeypatch):
    """specdecpp.verify is the package's function and was round 3's module; importing the module
    path rebinds the package attribute to the module, which still calls the function."""
    with pytest.warns(DeprecationWarning):
        importlib.import_module("specdecpp.verify")
    monkeypatch.setattr("specdecpp.core.verify.verify", lambda *args, **kwargs: ("called", args, kwargs))
    assert specdecpp.verify(1, greedy=True) == ("called", (1,), {"greedy": True})


def round3_names(old: str) -> list[str] | None:
    """The public names round 3's specdecpp/<old>.py defined, from git; None without the history."""
    git = shutil.which("git")
    if git is None:
        return None
    show = subprocess.run([git, "show", f"{ROUND3}:specdecpp/{old}.py"], cwd=REPO, capture_output=True, text=True)
    if show.returncode != 0:
        return None
    names = set()
    for node in ast.parse(show.stdout).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return sorted(n for n in names if not n.startswith("_"))


@pytest.mark.parametrize("old", sorted(NEW_HOMES))
def test_every_public_name_of_round_3_resolves_to_its_new_home(old):
    names = round3_names(old)
    if names is None:
        pytest.skip(f"round 3's specdecpp/{old}.py is not in this checkout's git history (a shallow clone)")
    with pytest.warns(DeprecationWarning):
        module = importlib.import_module(f"specdecpp.{old}")
    homes = [importlib.import_module(h) for h in NEW_HOMES[old]]
    for name in names:
        if (old, name) in RENAMED:
            with pytest.warns(DeprecationWarning):
                assert getattr(module, name) is obj(RENAMED[old, name])
            continue
        found = [getattr(h, name) for h in homes if hasattr(h, name)]
        assert found, f"round 3's specdecpp.{old}.{name} is in none of {NEW_HOMES[old]}"
        assert getattr(module, name) is found[0], name


def test_the_old_paths_go_in_the_release_named():
    """One release: once the version reaches REMOVED_IN, delete specdecpp/_moved.py, its import in
    specdecpp/__init__.py, this file and docs/api.md's "Moved modules"."""
    assert Version(specdecpp.__version__) < Version(_moved.REMOVED_IN), "the deprecated module paths are due to go"
    api = (REPO / "docs" / "api.md").read_text()
    assert "## Moved modules" in api and f"removed in {_moved.REMOVED_IN}" in api
    assert all(f"`specdecpp.{old}`" in api for old in NEW_HOMES)
