"""specdecpp_demo/build_feature_draft.py on a tiny random Llama target: data -> train -> resume ->
export (loads with FeatureDraft.from_pretrained), and the training-time test's unrolled forward
equals drafting with FeatureDraft.forward and a cache."""

from __future__ import annotations

import csv

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from specdecpp.models.feature_draft import FeatureDraft
from specdecpp_demo import build_feature_draft as build


def tiny_recipe(tmp_path, target: str, steps: int) -> dict:
    return {"seed": 0, "threads": 1, "target": target, "teacher_dtype": "float32", "work": str(tmp_path / "work"),
            "aux_layers": None, "draft_vocab": None, "max_tokens": 200,
            "data": {"top_k": 50, "max_new_tokens": 6, "forward_rows": 3,
                     "answers": {"split": "train", "prompts": 2, "prompts_per_shard": 1, "answers_per_prompt": 2,
                                 "rounds": 2},
                     "text": {"files": ["{stdlib}/json/*.py"], "shards": 2, "rows_per_shard": 2, "window": 12,
                              "text_share": 0.3},
                     "validation": {"split": "dev", "prompts": 2, "prompts_per_shard": 2, "answers_per_prompt": 1}},
            "train": {"ttt_steps": 3, "step_weights": None, "num_layers": 1, "train_lm_head": False,
                      "autocast_bf16": False, "steps": steps, "batch_rows": 2, "lr": 1e-3, "betas": [0.9, 0.95],
                      "warmup_steps": 1, "lr_floor": 0.1, "weight_decay": 0.0, "grad_clip": 1.0, "eval_every": 1,
                      "val_rows": None, "checkpoint_minutes": 4}}


def run(tmp_path, recipe: dict, stage: str) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    build.main([stage, "--config", str(path)])


def test_data_train_resume_export(tmp_path, tiny_pair):
    work = tmp_path / "work"
    run(tmp_path, tiny_recipe(tmp_path, tiny_pair.target, steps=1), "data")
    shards = sorted(p.name for p in (work / "shards").glob("*.safetensors"))
    assert any(n.startswith("val_") for n in shards) and any(n.startswith("text_") for n in shards)
    assert any(n.startswith("ans_") for n in shards)
    shard = build.read_shard(work / "shards" / shards[0])
    n = int(shard["lengths"].sum())
    target = AutoModelForCausalLM.from_pretrained(tiny_pair.target).eval()
    assert shard["features"].shape == (n, 2 * 48) and shard["features"].dtype == torch.bfloat16
    assert shard["topk_ids"].shape[0] == n and shard["loss_mask"].any()
    first = shard["token_ids"][: int(shard["lengths"][0])].long()[None]
    with torch.no_grad():
        out = target(first, output_hidden_states=True)
    want = torch.cat([out.hidden_states[0], out.hidden_states[1]], -1)[0]
    torch.testing.assert_close(shard["features"][: first.shape[1]].float(), want, atol=2e-2, rtol=2e-2)
    before = {p.name: p.stat().st_mtime_ns for p in (work / "shards").iterdir()}
    run(tmp_path, tiny_recipe(tmp_path, tiny_pair.target, steps=1), "data")  # resume: nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in (work / "shards").iterdir()} == before

    run(tmp_path, tiny_recipe(tmp_path, tiny_pair.target, steps=1), "train")
    assert torch.load(work / "checkpoint.pt", weights_only=False)["state"]["step"] == 1
    run(tmp_path, tiny_recipe(tmp_path, tiny_pair.target, steps=2), "train")  # resumes at step 1
    ckpt = torch.load(work / "checkpoint.pt", weights_only=False)
    assert ckpt["state"]["step"] == 2 and "embed_tokens.weight" not in ckpt["model"]
    rows = list(csv.DictReader(open(work / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(0.0 <= float(r["alpha_3"]) <= 1.0 for r in rows)
    assert (work / "metrics.png").is_file()

    run(tmp_path, tiny_recipe(tmp_path, tiny_pair.target, steps=2), "export")
    draft = FeatureDraft.from_pretrained(work / "export" / "full", target=target)
    assert draft.aux_layers == [0, 1]
    rebuilt = build.materialize(work / "export" / "artifact", target, tmp_path / "rebuilt")
    again = FeatureDraft.from_pretrained(rebuilt, target=target)
    for k, v in draft.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v)
    # the artifact records a held-out sample and the exported draft's figures on it: reproducible
    import json

    info = json.loads((work / "export" / "artifact" / "trained.json").read_text())
    check = info["check_sample"]
    assert len(check["token_ids"]) == 2 and check["metrics"]["val_positions"] > 0
    again_metrics = build.sample_metrics(again, target, check["token_ids"], check["loss_mask"], 3)
    for k, v in check["metrics"].items():
        assert again_metrics[k] == pytest.approx(v, abs=1e-5), k

    # a later session continues the artifact's training (train.init): its first eval is the artifact's draft
    recipe = tiny_recipe(tmp_path, tiny_pair.target, steps=0)
    recipe["work"], recipe["shards_dir"] = str(tmp_path / "work2"), str(work / "shards")
    recipe["train"]["init"] = str(work / "export" / "artifact")
    run(tmp_path, recipe, "train")
    best = torch.load(tmp_path / "work2" / "best.pt", weights_only=False)
    assert best["state"]["tokens_seen"] == info["tokens_seen"] > 0
    shipped = again.state_dict()
    for k, v in best["model"].items():
        assert torch.equal(v, shipped[k].to(v.dtype)), k  # the artifact's bf16 values, exactly
    recipe["train"]["init"] = str(tmp_path)
    (tmp_path / "work2" / "checkpoint.pt").unlink(missing_ok=True)
    (tmp_path / "work3").mkdir()
    recipe["work"] = str(tmp_path / "work3")
    with pytest.raises(FileNotFoundError, match="train.init .*no model.safetensors"):
        run(tmp_path, recipe, "train")
