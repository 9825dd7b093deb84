"""Inductor's C++ GEMM template, rendered without parsing the same text again (issue 33, compile time).

Under the CPU's tuned settings (:data:`specdecpp.models.static.TUNED_COMPILE_OPTIONS`: freezing and
the C++ GEMM template) inductor renders every matrix product of a graph from jinja templates twice,
once when it lists the product's kernel choices and once when it writes the graph's code: 542 renders
for one bucket of a 30-layer Llama. Each render

- compiles its jinja templates from their source again: ``KernelTemplate._template_from_string``
  calls ``Environment.from_string``, which keeps no cache (6,705 template compiles for that bucket);
- parses the kernel's index expressions from their text with sympy's ``parse_expr``
  (``cpp_template_kernel.parse_expr_with_index_symbols``; 25,328 parses).

Both are pure functions of a string, and the sources are a dozen constants of inductor's: the
same text gives a template that renders the same code, and the same sympy expression (sympy's
expressions are immutable). :func:`memoised_codegen` keeps each result by its text for the process
while a step compiles. On a 2-core Intel Xeon that took a 135M-parameter Llama's one-token bucket from
117-120 s to 71-74 s (docs/results/fast.md, "Compile time"). The generated code, and with it the
kernels, are the same (tests/models/test_codegen_memo.py). Each patch is applied only where this torch has the function
it replaces, with the signature it expects, and undone when the compile ends.
``SPECDECPP_CODEGEN_MEMO=0`` turns it off.
"""

from __future__ import annotations

import inspect
import logging
import os

from .patching import PatchSet, takes_arguments

log = logging.getLogger(__name__)

_TEMPLATES: dict[str, object] = {}  # a jinja template's source -> the template inductor compiled from it
_EXPRESSIONS: dict[str, object] = {}  # an index expression's text -> the sympy expression inductor parsed


def enabled() -> bool:
    """Whether compiles use the memos (``SPECDECPP_CODEGEN_MEMO=0`` turns them off)."""
    return os.environ.get("SPECDECPP_CODEGEN_MEMO", "1").strip() != "0"


def _by_text(fn, memo: dict):
    """``fn`` with its result kept in ``memo`` by its argument where that is a string (anything else
    goes to ``fn`` as it is: a sympy expression, a list of texts)."""
    def by_text(arg):
        if not isinstance(arg, str):
            return fn(arg)
        found = memo.get(arg)
        if found is None:
            found = memo[arg] = fn(arg)
        return found

    return by_text


def _patches() -> list[tuple[object, str, object, object]]:
    """(owner, attribute, original, replacement) for each function this torch has as expected."""
    try:
        import torch._inductor.compile_fx  # noqa: F401 (imports the codegen modules in the order their cycle needs)
        from torch._inductor.codegen import common, cpp_template_kernel
    except ImportError as exc:
        log.debug("no inductor codegen to memoise (%s)", exc)
        return []
    out = []
    template = getattr(common, "KernelTemplate", None)
    original = inspect.getattr_static(template, "_template_from_string", None) if template is not None else None
    if isinstance(original, staticmethod) and takes_arguments(original.__func__, 1):
        out.append((template, "_template_from_string", original,
                    staticmethod(_by_text(original.__func__, _TEMPLATES))))
    parse = getattr(cpp_template_kernel, "parse_expr_with_index_symbols", None)
    if parse is not None and takes_arguments(parse, 1):  # a list's items come back through the patched name
        out.append((cpp_template_kernel, "parse_expr_with_index_symbols", parse, _by_text(parse, _EXPRESSIONS)))
    return out


_MEMOS = PatchSet(_patches, enabled)


def memoised_codegen(on: bool | None = None):
    """Within it, inductor's jinja templates and its C++ template kernel's index expressions are kept
    by their text (module docstring). ``on``: None follows :func:`enabled`; False does nothing."""
    return _MEMOS.applied(on)
