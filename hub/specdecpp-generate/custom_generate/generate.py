"""SpecDec++ speculative decoding behind transformers' ``generate(custom_generate=...)``.

The code lives in the ``specdecpp`` package (specdecpp/hf.py), so this folder cannot drift from it:
``generate`` here is :func:`specdecpp.hf.hub_generate`, which takes ``generate``'s raw arguments.
"""

from specdecpp.hf import hub_generate as generate

__all__ = ["generate"]
