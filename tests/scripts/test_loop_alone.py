"""scripts/loop_alone.py at its smallest: tiny random Llamas, the static runner's steps recorded and
replayed; a replay must retrace the recorded call, and the JSON holds what the table shows."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from specdecpp.fast import runners
from tests.helpers.paths import REPO
from tests.scripts.test_bench_fast import write_configs

sys.path.insert(0, str(REPO / "scripts"))


def test_loop_alone_on_tiny_random_models(tmp_path, capsys):
    import loop_alone

    write_configs(tmp_path)
    out = tmp_path / "loop.json"
    real = runners.static_step
    assert loop_alone.main(["--configs", str(tmp_path), "--dtype", "float32", "--methods", "fixed_k2", "svip",
                            "--prompts", "2", "--max-new-tokens", "8", "--prompt-len", "8", "--repeats", "1",
                            "--flush-mb", "1", "--metered", "--out", str(out)]) == 0
    assert runners.static_step is real  # the runner's step is given back
    printed = capsys.readouterr().out
    assert "| fixed_k2 |" in printed and "| svip |" in printed
    result = json.loads(out.read_text())
    assert result["dtype"] == "float32" and result["prompts"] == 2 and result["flush_mb"] == 1 and result["metered"]
    assert set(result["methods"]) == {"fixed_k2", "svip"}
    for m in result["methods"].values():
        assert m["rounds"] == sum(c["rounds"] for c in m["calls"]) > 0
        assert m["warm_ms_per_round"] > 0 and m["cold_ms_per_round"] > 0
        assert m["cold_over_warm"] == pytest.approx(m["cold_ms_per_round"] / m["warm_ms_per_round"])
    with pytest.raises(SystemExit):
        loop_alone.main(["--configs", str(tmp_path), "--methods", "head"])  # no --head given
    assert "unknown ['head']" in capsys.readouterr().err


def test_a_replay_that_strays_from_the_record_is_refused(tmp_path):
    """The replay's check can fail: steps that hand back other logits than the recorded ones
    change the greedy tokens, and replay_call says so."""
    import argparse

    import loop_alone

    write_configs(tmp_path)
    args = argparse.Namespace(configs=str(tmp_path), random=False, dtype="float32", seed=0, prompts=1, prompt_len=8,
                              max_new_tokens=8, repeats=1, head=None, svip_threshold=0.3, svip_max=8)
    draft, target, _, _ = loop_alone.load(args, torch.device("cpu"))
    prompt = loop_alone.prompts(args, None, target.config.vocab_size, torch.device("cpu"))[0]
    decoder = loop_alone.SpeculativeDecoder(draft, target, loop_alone.methods(args, draft)["fixed_k2"],
                                            loop_alone.SAMPLINGS["greedy"], fast="static")

    class Straying(loop_alone.StepTape):
        def __call__(self, *a, **k):
            out = super().__call__(*a, **k)
            return out if self.mode == "record" else (out[0].flip(-1), out[1])

    for tape, fails in ((loop_alone.StepTape(1), False), (Straying(1), True)):
        real, runners.static_step = runners.static_step, tape
        try:
            if fails:
                with pytest.raises(RuntimeError, match="did not retrace"):
                    loop_alone.replay_call(decoder, tape, prompt, args, None, 0)
            else:
                call = loop_alone.replay_call(decoder, tape, prompt, args, None, 0)
                assert call["rounds"] > 0 and call["warm"] > 0 and call["cold"] > 0
        finally:
            runners.static_step = real
