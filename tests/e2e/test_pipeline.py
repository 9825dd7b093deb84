"""The apps chained on the tiny pair: data_gen's output trains as is."""

from __future__ import annotations

import json

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdecpp.stopping.head import AcceptanceHead
from tests.helpers.paths import CONF
from tests.helpers.train import base_overrides, train_cfg
from train import run


def test_trains_on_a_real_data_gen_output(tiny_pair, tmp_path):
    """The contract with data_gen: its output directory trains as is, and the head records it."""
    from data_gen import run as generate

    prompts = tmp_path / "prompts.jsonl"
    texts = ["Write a short poem about the sea.", "What is 12 times 7?", "def add(a, b):", "Explain binary search."]
    prompts.write_text("".join(json.dumps({"id": f"p{j}", "split": "train" if j < 3 else "dev", "prompt": t}) + "\n"
                               for j, t in enumerate(texts)))
    data = tmp_path / "data"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        generate(compose("data_gen", overrides=[
            f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "pair.device=cpu", "prompts=jsonl",
            f"prompts.path={prompts}", "splits=[train,dev]", f"out={data}", "max_new_tokens=8", "progress=false"]))
    result = run(train_cfg([*base_overrides(tiny_pair, data, tmp_path, "trainer=smoke", "callbacks=none"),
                            "+experiment=wrej6_d3"]))
    head = AcceptanceHead.from_pretrained(result["out"])
    assert head.meta["target"] == tiny_pair.target and head.draft == tiny_pair.draft
    assert set(result["metrics"]) == {"train", "dev"} and result["metrics"]["train"]["positions"] > 0
