"""Shared fixtures: tiny random Llama models and a tiny byte-level tokenizer, all built offline
(from tests/helpers/tiny.py; tests import helpers from tests/helpers/, never from here).

- ``tiny_models``: a (draft, target) pair over an 8-token vocabulary, for exact enumeration.
- ``tiny_pair``: draft and target saved as ordinary HF directories with a shared tokenizer
  (chat template, EOS); hidden sizes differ (draft 32, target 48). Use ``tiny_pair.draft`` and
  ``tiny_pair.target`` as paths wherever a model path is expected.
- ``prompts_file``: a jsonl of a few prompts in the train and dev splits (tests/helpers/data_gen.py).
- ``tiny_dataset``, ``draft``: a synthetic labelled dataset of ``tiny_pair`` (tests/helpers/train.py)
  and its draft loaded, for the training tests.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from specdecpp.models.loading import load_model
from tests.helpers.data_gen import PROMPTS
from tests.helpers.tiny import build_tokenizer, tiny_lm


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test runs torch on one thread (the suite's one place for this): tiny models are
    dominated by per-op overhead, and extra threads only add contention (10-20x slower on a
    loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def plain_compile_options():
    """Compiled tests use torch.compile's plain settings on a CPU: the tuned default (freezing +
    max_autotune) costs 3-4x the compile time and skips inductor's FX graph cache, which the suite
    cannot afford on CI's 2 cores. tests/models/test_compile_options.py compiles with the tuned ones."""
    from specdecpp.fast.compiling import COMPILE_OPTIONS, set_compile_options

    before = {k: dict(v) for k, v in COMPILE_OPTIONS.items()}
    set_compile_options("plain")
    yield
    COMPILE_OPTIONS.clear()
    COMPILE_OPTIONS.update(before)


@pytest.fixture(scope="session")
def tiny_models():
    """(draft, target) over 8 tokens: draft 1 layer, target 2 layers, different seeds."""
    return tiny_lm(8, 32, 1, seed=1, scale=0.6), tiny_lm(8, 32, 2, seed=2, scale=0.6)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Draft and target saved as HF directories sharing one tokenizer."""
    root = tmp_path_factory.mktemp("tiny_pair")
    tok = build_tokenizer()
    vocab = len(tok)
    paths = {}
    for name, hidden, layers, seed in (("draft", 32, 1, 11), ("target", 48, 2, 12)):
        model = tiny_lm(vocab, hidden, layers, seed=seed, scale=0.15)
        model.config.eos_token_id = tok.eos_token_id
        model.config.bos_token_id = tok.bos_token_id
        model.config.pad_token_id = tok.pad_token_id
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        paths[name] = str(d)
    return types.SimpleNamespace(draft=paths["draft"], target=paths["target"], tokenizer=tok,
                                 draft_hidden=32, target_hidden=48, vocab=vocab, root=root)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "split": s, "prompt": p}) + "\n" for i, s, p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def tiny_dataset(tiny_pair, tmp_path_factory):
    """A synthetic labelled dataset of the tiny pair (train 24, dev 8, test 8 rows) in the data_gen format."""
    from tests.helpers.train import (  # datasets: only where a test needs it (the 4.56 run)
        random_rows,
        save_dataset,
    )

    splits = {"train": random_rows(24, tiny_pair.vocab, 1), "dev": random_rows(8, tiny_pair.vocab, 2),
              "test": random_rows(8, tiny_pair.vocab, 3)}
    return save_dataset(tmp_path_factory.mktemp("tiny_data"), splits, tiny_pair.draft, 32, tiny_pair.vocab)


@pytest.fixture(scope="module")
def draft(tiny_pair):
    """The tiny pair's draft, loaded."""
    return load_model(tiny_pair.draft, "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
