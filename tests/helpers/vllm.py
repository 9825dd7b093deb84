"""vLLM in the tests (tests/vllm/): skip where vLLM is not installed, the settings that run it on a
shared 2-core CPU, tiny random pairs it can load, and a recorder of the per-request draft lengths.

vLLM lives in its own environment (``make vllm-env``); ``make test-vllm`` runs tests/vllm/ there.
The system environment has no vLLM, and these modules skip there (the config tests do not need it).
"""

from __future__ import annotations

import gc
import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.tiny import build_tokenizer, noisy_copy, tiny_lm

# vLLM on one thread, in this process (the recorder below and the proposer's patches need that),
# with a small KV cache; set before vLLM is imported.
VLLM_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1"}


# vLLM's own deprecated calls (torch.distributed.reduce_op, ...), not ours: the suite errors on ours
VLLM_WARNINGS = pytest.mark.filterwarnings("ignore::FutureWarning:vllm", "ignore::DeprecationWarning:vllm",
                                           "ignore::FutureWarning:torch", "ignore::DeprecationWarning:torch")


def require_vllm() -> None:
    """Skip the calling module where vLLM is not installed (without importing it: that takes ~20 s)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this environment (make vllm-env; make test-vllm)",
                    allow_module_level=True)
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)


def save_pair(root: Path, vocab: int | None = None, noise: float | None = None) -> tuple[Path, Path]:
    """A draft and a target vLLM's CPU backend can load (head sizes of 32: its smallest): with the
    tests' byte-level tokenizer (``vocab`` None), or over ``vocab`` ids without a tokenizer, the
    draft then a ``noise`` copy of the target (agreeing often, for the sampled tests)."""
    tok = build_tokenizer() if vocab is None else None
    size = len(tok) if tok is not None else vocab
    target = tiny_lm(size, 128, 2, seed=12, scale=0.15 if tok is not None else 0.5, heads=4)
    draft = tiny_lm(size, 64, 1, seed=11, scale=0.15, heads=2) if noise is None else noisy_copy(target, noise, seed=4)
    paths = []
    for name, model in (("draft", draft), ("target", target)):
        if tok is not None:
            model.config.update({"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
                                 "pad_token_id": tok.pad_token_id})
        model.save_pretrained(root / name)
        if tok is not None:
            tok.save_pretrained(root / name)
        paths.append(root / name)
    return paths[0], paths[1]


def start(target: Path, speculative_config=None, **options):
    """A vLLM engine of ``target`` as the tests run it: float32, eager, small."""
    from vllm import LLM

    settings = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 16, "enforce_eager": True, "seed": 0,
                "disable_log_stats": False, **options}
    return LLM(model=str(target), speculative_config=speculative_config, **settings)


def close(llm) -> None:
    """Release an engine before the next starts (one in-process engine at a time)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def spec_metrics(llm) -> dict:
    """vLLM's ``vllm:spec_decode_*`` counters, by name without the prefix."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


@contextmanager
def recorded_lengths():
    """The per-request draft lengths each propose call hands vLLM, in order: a list of lists."""
    from specdecpp.vllm import drafts

    seen: list[list[int]] = []
    original = drafts.StoppedDrafts.lists

    def lists(self, batch_size):
        out = original(self, batch_size)
        seen.append([len(row) for row in out])
        return out

    drafts.StoppedDrafts.lists = lists
    try:
        yield seen
    finally:
        drafts.StoppedDrafts.lists = original
