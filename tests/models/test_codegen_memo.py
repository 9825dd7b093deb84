"""specdecpp.fast.torch_internals, ``codegen_memo`` (off by default): inductor's jinja templates and its
C++ template kernel's index
expressions kept by their text while a step compiles. The memoised functions return what the
originals return (the same rendering, equal sympy expressions), each text is compiled or parsed
once, the originals are back after the block, and (slow) a graph compiled with the C++ GEMM
template gets the same code with the memos as without."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch._inductor.compile_fx  # noqa: F401 (imports the codegen modules in the order their cycle needs)
from torch._inductor.codegen import cpp_template_kernel
from torch._inductor.codegen.common import KernelTemplate

from specdecpp.fast import torch_internals
from specdecpp.fast.step import own_code
from specdecpp.fast.torch_internals import ENV, enabled, memoised_codegen

SOURCE = "{% for n in names %}{{ n }} = {{ value|indent_except_first(1) }};\n{% endfor %}"
EXPRESSIONS = ["m_end - m_start", "n_start + 2*Nr", "Mc_blocks*Mr", "0", "k_end"]


def current():
    return (inspect.getattr_static(KernelTemplate, "_template_from_string"),
            cpp_template_kernel.parse_expr_with_index_symbols)


def test_templates_compiled_once_and_render_the_same():
    before = current()
    fresh = KernelTemplate._template_from_string(SOURCE)  # the original: a new template each call
    assert fresh is not KernelTemplate._template_from_string(SOURCE)
    options = {"names": ["a", "b"], "value": "x\ny"}
    with memoised_codegen(True):
        first = KernelTemplate._template_from_string(SOURCE)
        assert KernelTemplate._template_from_string(SOURCE) is first
        assert first.render(**options) == fresh.render(**options) == "a = x\n    y;\nb = x\n    y;\n"
        with memoised_codegen(True):  # nested: patched once, still patched after the inner block
            assert KernelTemplate._template_from_string(SOURCE) is first
        assert KernelTemplate._template_from_string(SOURCE) is first
    assert current() == before


def test_expressions_parsed_once_and_equal():
    before = current()
    parse = cpp_template_kernel.parse_expr_with_index_symbols
    expected = [parse(e) for e in EXPRESSIONS]
    with memoised_codegen(True):
        memo = cpp_template_kernel.parse_expr_with_index_symbols
        assert memo is not parse
        got = [memo(e) for e in EXPRESSIONS]
        assert got == expected
        # integer index symbols
        assert all(g.free_symbols == e.free_symbols for g, e in zip(got, expected, strict=True))
        assert all(memo(e) is g for e, g in zip(EXPRESSIONS, got, strict=True))  # parsed once
        assert memo(EXPRESSIONS[:2]) == expected[:2]  # a list item by item, as the original
        assert memo(expected[0]) is expected[0]  # a sympy expression as it is
    assert current() == before


def test_off_by_default_and_on_by_opting_in(monkeypatch):
    before = current()
    with memoised_codegen(False):
        assert current() == before
    monkeypatch.delenv(ENV, raising=False)
    assert not enabled("codegen_memo")
    with memoised_codegen():
        assert current() == before
    for value in ("codegen_memo", "all", "packed_cache,codegen_memo"):
        monkeypatch.setenv(ENV, value)
        assert enabled("codegen_memo")
        with memoised_codegen():
            assert current() != before
        assert current() == before


def test_restored_after_an_error():
    before = current()
    with pytest.raises(RuntimeError, match="inside"), memoised_codegen(True):
        assert current() != before
        raise RuntimeError("inside")
    assert current() == before


def normalised(codes: list[str]) -> list[str]:
    """Generated code without what differs between two compiles of one graph in a process: the
    compile's number (``# AOT ID``), the addresses of the constants in its comments, file paths."""
    out = []
    for code in codes:
        code = re.sub(r"# AOT ID: .*", "# AOT ID", code)
        code = re.sub(r" [0-9a-f]{8,16}$", " <address>", code, flags=re.MULTILINE)
        out.append(re.sub(r"/[^\s'\"]*torchinductor[^\s'\"]*", "<path>", code))
    return out


@pytest.mark.slow
def test_same_code_with_and_without_the_memos():
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 48)).eval()
    x = torch.randn(2, 64)
    options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    def run(x):
        return model(x)

    codes, outs = {}, {}
    for on in (False, True):
        torch_internals._TEMPLATES.clear()
        torch_internals._EXPRESSIONS.clear()
        step = own_code(run, f"codegen_memo_{'on' if on else 'off'}")  # a code object of its own: a first compile
        with torch.no_grad(), inductor_config.patch(freezing=True, force_disable_caches=True), memoised_codegen(on):
            compiled = torch.compile(step, fullgraph=True, dynamic=False, options=options)
            outs[on], codes[on] = run_and_get_code(compiled, x)
        if on:
            used = bool(torch_internals._TEMPLATES)
    assert len(codes[False]) == len(codes[True]) == 1
    if not used:
        pytest.skip("inductor's C++ GEMM template does not run on this CPU (no template was rendered)")
    assert torch_internals._EXPRESSIONS  # the template kernel's expressions went through the memo
    assert normalised(codes[True]) == normalised(codes[False])
    assert torch.equal(outs[True], outs[False])
