"""infer's HF baseline (method=hf_assisted, infer/hf_assisted.py) logs nothing: transformers'
messages about its own call of the draft's generate (deprecated on 5.x, "defaults modified" on
4.56) are dropped inside that call only, and the tokens are those of a user's plain
``target.generate(assistant_model=draft)`` with the same settings, in every mode, greedy and
sampled. The whole harness's hf_assisted rows: tests/apps/infer/test_infer.py."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from infer.hf_assisted import ASSISTANT_CALL_MESSAGES, HF_MODES, HFAssisted
from specdecpp.core.sampling import SamplingConfig
from tests.helpers.tiny import tiny_lm

MAX_NEW = 12
SAMPLINGS = {"greedy": SamplingConfig(temperature=0.0), "sampled": SamplingConfig(temperature=0.8, top_k=10, top_p=0.9)}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _logged(call):
    """(result, transformers' log messages at warning level and above, Python warnings) of
    ``call()``; transformers' once-only cache is cleared first, so a message an earlier call logged
    is logged again."""
    import transformers

    logging.Logger.warning_once.cache_clear()  # transformers' warning_once (functools.lru_cache)
    handler, verbosity = _Records(), transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)
    return result, handler.messages, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def pair():
    draft, target = tiny_lm(40, 16, 1, seed=5), tiny_lm(40, 32, 2, seed=6)
    for m in (draft, target):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    return draft, target, torch.randint(1, 40, (1, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("mode", HF_MODES)
def test_hf_assisted_logs_nothing_and_decodes_as_plain_assisted_generate(pair, mode, sampling):
    draft, target, ids = pair
    s = SAMPLINGS[sampling]
    runner = HFAssisted(mode, num_assistant_tokens=3, confidence_threshold=0.3).runner(draft, target, s)

    def plain():  # a user's call: the draft's settings on its generation config, the rest as arguments
        for key, value in runner.assistant_settings.items():
            setattr(draft.generation_config, key, value)
        torch.manual_seed(7)
        kw = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p} if not s.greedy else {}
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                              max_new_tokens=MAX_NEW, do_sample=not s.greedy, pad_token_id=0, **kw)
        return out[0, ids.shape[1]:].tolist()

    reference, plain_log, _ = _logged(plain)
    # the capture sees transformers' message about its own draft call (if this fails, transformers
    # no longer logs it: drop infer.hf_assisted.quiet_assistant_calls)
    assert any(m.startswith(ASSISTANT_CALL_MESSAGES) for m in plain_log), plain_log
    (output_ids, stats, _), log, caught = _logged(lambda: runner.generate(ids, MAX_NEW, 7, None))
    assert log == [] and caught == [], (log, caught)
    assert output_ids == reference and stats.n_generated == MAX_NEW
    assert "generate" not in draft.__dict__  # the wrapper is gone
    if s.greedy:
        plain_greedy = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                       do_sample=False, pad_token_id=0)
        assert output_ids == plain_greedy[0, ids.shape[1]:].tolist()
