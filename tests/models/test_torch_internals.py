"""specdecpp.fast.torch_internals, the one home of the fast path's patches of torch and
transformers internals: which pieces are on (``SPECDECPP_TORCH_INTERNALS``); for each piece, that
what it patches or calls exists on the installed torch or transformers with the shape it expects
(each piece falls back quietly at run time, so these tests are what notices an internal that moved);
and that no other module of the library assigns to a torch or transformers attribute."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from specdecpp.fast import torch_internals
from specdecpp.fast.torch_internals import COMPILE_TIME, DECODE_TIME, ENV, PIECES, chosen, enabled
from tests.helpers.paths import REPO


def test_compile_time_pieces_are_off_and_decode_time_ones_on_by_default(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert set(COMPILE_TIME) == {"codegen_memo", "packed_cache"} and set(DECODE_TIME) == {"direct_call", "config_dict"}
    assert chosen() == set(DECODE_TIME) and not any(enabled(p) for p in COMPILE_TIME)
    assert chosen("") == chosen("default") == set(DECODE_TIME)
    assert chosen("all") == set(PIECES) and chosen("none") == set()
    assert chosen("codegen_memo,packed_cache") == set(PIECES)  # named pieces join the defaults
    assert chosen("-direct_call") == {"config_dict"} and chosen("none,packed_cache") == {"packed_cache"}
    assert chosen("all, -packed_cache, default") == set(DECODE_TIME)  # read left to right
    monkeypatch.setenv(ENV, "none")
    assert not any(enabled(p) for p in PIECES)
    with pytest.raises(ValueError, match=f"{ENV}='codegen': unknown piece 'codegen'"):
        chosen("codegen")
    with pytest.raises(ValueError, match="unknown piece"):
        enabled("direct")


def test_codegen_memo_finds_both_functions_it_memoises():
    """``codegen_memo``: ``KernelTemplate._template_from_string`` a staticmethod of one argument and
    ``cpp_template_kernel.parse_expr_with_index_symbols`` a function of one argument."""
    patches = torch_internals.codegen_patches()  # imports inductor's codegen modules in the order they need
    from torch._inductor.codegen import common, cpp_template_kernel

    assert [(owner, name) for owner, name, _, _ in patches] == [
        (common.KernelTemplate, "_template_from_string"), (cpp_template_kernel, "parse_expr_with_index_symbols")], \
        "inductor's template or index-expression parser moved: codegen_memo no longer applies on this torch"


def test_packed_cache_finds_the_check_and_the_reducer_it_patches():
    """``packed_cache``: ``CacheabilityValidator.check_tensor`` a staticmethod of one argument,
    ``FxGraphCachePickler._reduce_tensor`` a method of (self, tensor), ``codecache._ident``."""
    from torch._inductor import codecache

    patches = torch_internals.packed_patches()
    assert [(owner, name) for owner, name, _, _ in patches] == [
        (codecache.CacheabilityValidator, "check_tensor"), (codecache.FxGraphCachePickler, "_reduce_tensor")], \
        "inductor's FX graph cache moved: packed_cache no longer applies on this torch"
    assert callable(codecache._ident) and codecache._ident(("k",)) == ("k",)


def test_direct_call_finds_the_backend_it_extends_and_the_global_state_check():
    """``direct_call``: ``torch._TorchCompileInductorWrapper(mode, options, dynamic)`` called as
    ``(gm, example_inputs)``, and ``torch._C._dynamo.guards.GlobalStateGuard`` with ``check()``."""
    base = getattr(torch, "_TorchCompileInductorWrapper", None)
    assert base is not None, "torch._TorchCompileInductorWrapper is gone: direct_call no longer applies"
    params = list(inspect.signature(base.__init__).parameters.values())
    assert [p.name for p in params[:4]] == ["self", "mode", "options", "dynamic"]
    assert all(p.default is not inspect.Parameter.empty for p in params[4:])  # anything newer is optional
    params = list(inspect.signature(base.__call__).parameters.values())
    assert [p.name for p in params[:3]] == ["self", "model_", "inputs_"]  # the graph module, its example inputs
    assert all(p.default is not inspect.Parameter.empty for p in params[3:])
    graphs: list = []
    backend = torch_internals.keeping_backend({"max_autotune": False}, graphs)
    assert isinstance(backend, base) and backend.options == {"max_autotune": False} and backend.graphs is graphs
    guard = torch._C._dynamo.guards.GlobalStateGuard()
    assert guard.check() is True
    with torch.no_grad():
        assert guard.check() is False  # another autograd state: the direct call is not taken


def test_direct_call_off_compiles_through_the_public_api(monkeypatch):
    monkeypatch.setenv(ENV, "-direct_call")
    assert torch_internals.keeping_backend({}, []) is None


def test_config_dict_finds_where_transformers_keeps_the_attention_choice():
    """``config_dict``: ``PretrainedConfig._attn_implementation`` a property over the instance
    dict's ``_attn_implementation_internal`` (a Llama config has no sub-configs)."""
    from transformers import LlamaConfig, PretrainedConfig

    assert isinstance(inspect.getattr_static(PretrainedConfig, "_attn_implementation"), property)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    assert torch_internals.stored_directly(config), \
        "transformers keeps config._attn_implementation elsewhere now: config_dict no longer applies"


def torch_names(tree: ast.Module) -> set[str]:
    """The names a module binds to torch or transformers (``import torch``, ``import torch._x as x``,
    ``from torch._inductor import config``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names
                      if a.name.split(".")[0] in ("torch", "transformers")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in ("torch", "transformers"):
            names |= {a.asname or a.name for a in node.names}
    return names


def root(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_other_module_assigns_to_torch_or_transformers():
    """Outside torch_internals no module of the library assigns to an attribute of a torch or
    transformers module or class it imported, calls ``setattr`` on one, or names the config's
    private attention slot."""
    found = []
    for path in sorted((REPO / "specdecpp").rglob("*.py")):
        if path.name == "torch_internals.py":
            continue
        text = path.read_text()
        tree = ast.parse(text, filename=str(path))
        names = torch_names(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            found += [f"{path.name}:{node.lineno}" for t in targets
                      if isinstance(t, (ast.Attribute, ast.Subscript)) and root(t) in names]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("setattr", "delattr") and node.args and root(node.args[0]) in names:
                found.append(f"{path.name}:{node.lineno}")
        if torch_internals.STORED in text:
            found.append(f"{path.name}: {torch_internals.STORED}")
    assert found == []
