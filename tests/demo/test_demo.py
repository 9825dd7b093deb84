"""The demo pair: the shipped draft artifact, its materialisation, the distillation and measurement
scripts, the shipped reference heads. On the real pair (slow): tests/e2e/test_real_pair.py."""

from __future__ import annotations

import importlib
import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import save_file

import specdecpp_demo.pair as demo
from specdecpp.models.loading import load_tokenizer
from specdecpp_demo import projected
from tests.helpers.paths import REPO


def load_script(name: str):
    """A builder of specdecpp_demo (``python -m specdecpp_demo.<name>``)."""
    return importlib.import_module(f"specdecpp_demo.{name}")


def tiny_projected_draft(build, vocab: int):
    """A width-16, one-layer ProjectedDraft over a random [vocab, 24] target embedding."""
    llama = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
             "head_dim": 8, "intermediate_size": 32, "max_position_embeddings": 64}
    torch.manual_seed(0)
    return build.ProjectedDraft(llama, torch.randn(vocab, 24), torch.randn(24, 16), torch.randn(24, 16))


@pytest.fixture
def fake_target(tmp_path, tiny_pair):
    """A directory with the tiny tokenizer and a random embedding matrix of the real target's width."""
    target = tmp_path / "target"
    shutil.copytree(tiny_pair.target, target)
    vocab = len(load_tokenizer(str(target)))
    torch.manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(vocab, 576)}, str(target / "model.safetensors"))
    return target


@pytest.fixture
def demo_cache(tmp_path, monkeypatch, fake_target):
    """SPECDECPP_CACHE in tmp_path, with the fake target already materialised there."""
    monkeypatch.setenv("SPECDECPP_CACHE", str(tmp_path / "cache"))
    target = demo.cache_dir() / "target"
    shutil.copytree(fake_target, target)
    (target / demo.STAMP).write_text("{}")
    return demo.cache_dir()


def test_artifact_is_small_and_records_its_recipe():
    files = list(projected.ARTIFACT_DIR.iterdir())
    assert sum(f.stat().st_size for f in files) <= 20e6
    cfg = projected.draft_config()
    assert cfg["target"]["hub_id"] == demo.TARGET_HUB_ID
    assert cfg["recipe"]["draft"]["hidden_size"] == cfg["llama_config"]["hidden_size"]
    assert cfg["trained"]["train_tokens"] > 0


def test_artifact_rebuilds_a_draft_with_projected_embeddings(fake_target):
    model = demo.load_draft_artifact(fake_target)
    cfg = projected.draft_config()
    width = cfg["llama_config"]["hidden_size"]
    vocab = len(load_tokenizer(str(fake_target)))
    assert model.model.embed_tokens.weight.shape == (vocab, width)
    assert model.lm_head.weight.shape == (vocab, width)
    assert len(model.model.layers) == cfg["llama_config"]["num_hidden_layers"]
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, vocab) and torch.isfinite(logits).all()


def test_artifact_for_another_target_width_is_refused(tmp_path, fake_target):
    save_file({"model.embed_tokens.weight": torch.randn(10, 64)}, str(fake_target / "model.safetensors"))
    with pytest.raises(ValueError, match="another target"):
        demo.load_draft_artifact(fake_target)


def test_missing_artifact_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="specdecpp_demo.build_draft"):
        projected.draft_config(tmp_path / "nowhere")


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECPP_CACHE", str(tmp_path))
    assert demo.cache_dir() == tmp_path.resolve() / "demo"
    monkeypatch.delenv("SPECDECPP_CACHE")  # as conf/pair/demo.yaml: .cache under the working directory
    monkeypatch.chdir(tmp_path)
    assert demo.cache_dir() == tmp_path.resolve() / ".cache" / "demo"


def test_materialised_draft_is_an_hf_model_with_the_target_tokenizer(demo_cache):
    from transformers import AutoModelForCausalLM

    from specdecpp.models.loading import check_tokenizers

    draft_dir = demo.demo_draft_path()
    assert draft_dir == demo_cache / "draft"
    check_tokenizers(load_tokenizer(str(draft_dir)), load_tokenizer(str(demo_cache / "target")))
    hf = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    rebuilt = demo.load_draft_artifact(demo_cache / "target")
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, rebuilt(ids).logits)


def test_materialised_draft_scores_only_its_output_vocabulary(demo_cache, tmp_path):
    from specdecpp.models.loading import load_model
    from specdecpp.models.reduced_vocab import OUTPUT_VOCAB_FILE, ReducedOutput

    vocab = json.loads((projected.ARTIFACT_DIR / projected.ARTIFACT_VOCAB).read_text())
    assert vocab["size"] == len(vocab["token_ids"]) < vocab["vocab_size"]
    assert set(vocab["special_tokens"]) <= set(vocab["token_ids"])
    assert vocab["teacher_mass_covered_on_held_out_shard"] > 0.9
    # the fake target's vocabulary is tiny: an artifact whose output vocabulary fits it
    artifact = tmp_path / "artifact"
    shutil.copytree(projected.ARTIFACT_DIR, artifact)
    (artifact / projected.ARTIFACT_VOCAB).write_text(json.dumps({**vocab, "token_ids": [0, 3, 5, 7, 11]}))
    draft_dir = demo.demo_draft_path(artifact)
    assert (draft_dir / OUTPUT_VOCAB_FILE).is_file()
    layer = load_model(str(draft_dir), "cpu").get_output_embeddings()
    assert isinstance(layer, ReducedOutput) and layer.token_ids.tolist() == [0, 3, 5, 7, 11]


def test_draft_is_rematerialised_only_when_the_artifact_changes(demo_cache, tmp_path):
    artifact = tmp_path / "artifact"
    shutil.copytree(projected.ARTIFACT_DIR, artifact)
    weights = demo.demo_draft_path(artifact) / "model.safetensors"
    first = weights.stat().st_mtime_ns
    assert demo.demo_draft_path(artifact) / "model.safetensors" == weights
    assert weights.stat().st_mtime_ns == first
    cfg = json.loads((artifact / projected.ARTIFACT_CONFIG).read_text())
    cfg["note"] = "changed"
    (artifact / projected.ARTIFACT_CONFIG).write_text(json.dumps(cfg))
    demo.demo_draft_path(artifact)
    assert json.loads((demo_cache / "draft" / demo.STAMP).read_text())["artifact_sha256"] == \
        demo.artifact_digest(artifact)
    before = demo.artifact_digest(artifact)  # the output vocabulary is part of the artifact too
    vocab = json.loads((artifact / projected.ARTIFACT_VOCAB).read_text())
    vocab["token_ids"] = vocab["token_ids"][:-1]
    (artifact / projected.ARTIFACT_VOCAB).write_text(json.dumps(vocab))
    assert demo.artifact_digest(artifact) != before


def test_two_processes_wanting_the_draft_at_once_build_it_once(demo_cache, tmp_path, monkeypatch):
    """The demo pair is built under a lock: callers that arrive together (test workers, data_gen's
    workers) wait for the first build and reuse it, instead of building twice over each other."""
    import threading
    import time

    artifact = tmp_path / "artifact"
    shutil.copytree(projected.ARTIFACT_DIR, artifact)
    builds, build = [], demo.materialise_draft

    def slow_build(*a, **kw):
        builds.append(1)
        time.sleep(0.5)  # the other caller arrives while this one builds
        return build(*a, **kw)

    monkeypatch.setattr(demo, "materialise_draft", slow_build)
    got = []
    callers = [threading.Thread(target=lambda: got.append(demo.demo_draft_path(artifact))) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(builds) == 1 and got == [demo_cache / "draft"] * 2
    assert (demo_cache / "draft" / demo.STAMP).is_file()


def test_distillation_draft_exports_to_the_same_model(tmp_path):
    """The class specdecpp_demo.build_draft trains is the one the materialiser rebuilds: its artifact tensors
    come back as a LlamaForCausalLM with the same logits (up to the float16 layers)."""
    build = load_script("build_draft")
    assert build.ProjectedDraft is projected.ProjectedDraft
    llama = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 8, "intermediate_size": 64, "max_position_embeddings": 64}
    torch.manual_seed(0)
    embeddings = torch.randn(50, 48)
    draft = build.ProjectedDraft(llama, embeddings, torch.randn(48, 32) / 7, torch.randn(48, 32) / 7)
    hf = projected.ProjectedDraft.from_artifact_tensors(llama, draft.artifact_tensors(), embeddings).to_causal_lm()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, draft(ids) @ draft.output_matrix().T, atol=5e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="does not match its config"):
        projected.ProjectedDraft.from_artifact_tensors({**llama, "num_hidden_layers": 2}, draft.artifact_tensors(),
                                                       embeddings)


def test_prompt_shards_answer_the_train_split_and_validate_on_dev(tiny_pair):
    """conf/distill/continue_bundled.yaml: shard i answers bundled train prompt i mod n, the val_*
    shards answer dev prompts, every shard has its own seed, and no test prompt is ever used."""
    import yaml

    from specdecpp.data.prompts import encode_prompt, load_prompts

    build = load_script("build_draft")
    recipe = yaml.safe_load((REPO / "conf" / "distill" / "continue_bundled.yaml").read_text())
    recipe["generate"]["shards"] = 235  # past the end of the train split: it wraps around
    plan = build.prompt_shard_plan(recipe, tiny_pair.tokenizer)
    train, dev = load_prompts("bundled", "train"), load_prompts("bundled", "dev")
    val_n = recipe["generate"]["validation"]["prompts"]
    assert sorted(plan) == sorted([f"{i:04d}" for i in range(235)] + [f"val_{j:04d}" for j in range(val_n)])
    tok = tiny_pair.tokenizer
    assert plan["0007"][0] == encode_prompt(tok, train[7].prompt)
    assert plan["0232"][0] == encode_prompt(tok, train[2].prompt)  # 232 mod 230
    assert plan["val_0003"][0] == encode_prompt(tok, dev[3].prompt)
    assert len({seed for _, seed in plan.values()}) == len(plan)
    test_ids = {tuple(encode_prompt(tok, t.prompt)) for t in load_prompts("bundled", "test")}
    assert not test_ids & {tuple(ids) for ids, _ in plan.values()}


def test_held_out_acceptance_weighs_every_position_of_every_shard():
    build = load_script("build_draft")
    draft = tiny_projected_draft(build, 80)

    def shard(rows, prompt_len, new):
        return {"tokens": torch.randint(80, (rows, prompt_len + new)), "topk_logits": torch.randn(rows, new, 64),
                "topk_ids": torch.stack([torch.randperm(80)[:64] for _ in range(rows * new)]).reshape(rows, new, 64),
                "prompt_len": prompt_len}

    a, b = shard(2, 3, 5), shard(3, 6, 4)  # 10 and 12 positions
    acc_a, acc_b = build.acceptance(draft, a, 8), build.acceptance(draft, b, 8)
    assert 0 < acc_a < 1 and 0 < acc_b < 1 and acc_a != pytest.approx(acc_b)
    assert build.acceptance(draft, [a, b], 8) == pytest.approx((10 * acc_a + 12 * acc_b) / 22)
    assert build.acceptance(draft, [a, b], 1) == pytest.approx((5 * build.acceptance(draft, a, 1)
                                                                 + 4 * build.acceptance(draft, b, 1)) / 9)


@pytest.mark.parametrize("answers", [False, True], ids=["conversations", "prompt_answers"])
def test_distillation_train_holds_out_its_validation_shards_and_resumes_exactly(tmp_path, monkeypatch, answers):
    """specdecpp_demo.build_draft train on tiny shards with a tiny target: conversations hold out shard 0,
    prompt answers the val_* shards (no training batch comes from them); a run interrupted after a
    checkpoint resumes and ends with the same weights and history as an uninterrupted one."""
    from tests.helpers.tiny import tiny_lm

    build = load_script("build_draft")
    target = tiny_lm(400, 24, 1, seed=2)
    monkeypatch.setattr(build, "load_target", lambda *a: (target, None))
    recipe = {"seed": 0, "draft": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32},
              "generate": ({"prompts": {"source": "bundled", "split": "train"},
                            "validation": {"split": "dev", "prompts": 2, "batch_size": 2}} if answers else {}),
              "train": {"steps": 6, "restarts": [], "batch_size": 2, "negatives": 32, "text_share": 0.0,
                        "lr": 1e-3, "projection_lr": 1e-4, "warmup_steps": 2, "weight_decay": 0.0,
                        "eval_every": 3, "eval_rows": 2, "checkpoint_every": 2, "hidden_samples": 16}}
    names = ["val_0000", "val_0001", "0000", "0001"] if answers else ["0000", "0001", "0002"]
    held_out = names[:2] if answers else names[:1]
    for run in ("straight", "interrupted"):
        g = torch.Generator().manual_seed(0)
        (tmp_path / run / "shards").mkdir(parents=True)
        for name in names:
            rows, prompt_len, new = 3, 3, 5
            save_file({"tokens": torch.randint(400, (rows, prompt_len + new), generator=g).int(),
                       "topk_logits": torch.randn(rows, new, 64, generator=g).sort(-1, descending=True).values.half(),
                       "topk_ids": torch.stack([torch.randperm(400, generator=g)[:64] for _ in range(rows * new)])
                       .reshape(rows, new, 64).int()},
                      str(tmp_path / run / "shards" / f"{name}.safetensors"), metadata={"prompt_len": str(prompt_len)})
    held_tokens = [build.read_shard(tmp_path / "straight" / "shards" / f"{n}.safetensors")["tokens"] for n in held_out]
    make_batch, batches = build.make_batch, []

    def spy_batch(shard, rng, batch_size):
        batches.append(shard["tokens"])
        return make_batch(shard, rng, batch_size)

    monkeypatch.setattr(build, "make_batch", spy_batch)
    build.train(recipe, tmp_path / "straight")
    assert len(batches) == 6 and not any(torch.equal(b, h) for b in batches for h in held_tokens)

    save_atomic = build.save_atomic

    def interrupt_at_step_4(obj, path):
        save_atomic(obj, path)
        if path.name == "checkpoint.pt" and obj["state"]["step"] == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(build, "save_atomic", interrupt_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        build.train(recipe, tmp_path / "interrupted")
    monkeypatch.setattr(build, "save_atomic", save_atomic)
    build.train(recipe, tmp_path / "interrupted")  # resumes at step 4

    straight, resumed = (torch.load(tmp_path / r / "checkpoint.pt", weights_only=False)
                         for r in ("straight", "interrupted"))
    assert straight["state"]["step"] == resumed["state"]["step"] == 6
    assert [h["step"] for h in straight["state"]["history"]] == [0, 3, 6]
    assert straight["state"]["history"] == resumed["state"]["history"]
    for k, v in straight["model"].items():
        torch.testing.assert_close(resumed["model"][k], v, rtol=0, atol=0)
    # step 0's figure is the initial draft's acceptance on exactly the held-out shards
    first = build.initial_draft(recipe, target, build.read_shard(
        tmp_path / "straight" / "shards" / f"{names[-2 if answers else 1]}.safetensors"))
    val = [build.read_shard(tmp_path / "straight" / "shards" / f"{n}.safetensors") for n in held_out]
    assert straight["state"]["history"][0]["val_acceptance"] == pytest.approx(build.acceptance(first, val, 2))


def test_sampled_softmax_matches_the_full_softmax_when_every_token_is_drawn():
    build = load_script("build_draft")
    draft = tiny_projected_draft(build, 30)
    hidden = torch.randn(5, 16)
    teacher_ids = torch.stack([torch.randperm(30)[:4] for _ in range(5)])
    full = (hidden @ draft.output_matrix().T).log_softmax(-1).gather(-1, teacher_ids)
    sampled = build.sampled_logq(draft, hidden, teacher_ids, 100_000, torch.Generator().manual_seed(0))
    torch.testing.assert_close(sampled, full, atol=2e-2, rtol=0)


def test_kl_loss_is_zero_only_for_the_teacher():
    build = load_script("build_draft")
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    assert build.kl_loss(p, torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]]))).abs() < 1e-6
    assert build.kl_loss(p, torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25]]))) > 0.05


def test_distillation_schedule_warm_restart_repeats_the_cycle():
    build = load_script("build_draft")
    one = [build.lr_factor(s, 10, 100) for s in range(100)]
    assert one[0] == pytest.approx(0.1) and one[9] == 1.0 and one[99] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(one[9:], one[10:], strict=False))  # cosine decays monotonically
    restarted = [build.lr_factor(s, 10, 250, [100]) for s in range(250)]
    assert restarted[:100] == one  # the first cycle is the run being continued, unchanged
    second = [build.lr_factor(s, 10, 150) for s in range(150)]
    assert restarted[100:] == second  # the continuation is a fresh warm-up + cosine over its own length




def test_shipped_reference_heads_name_the_shipped_draft_and_fit_it(demo_cache):
    """demo/heads/ belongs to this draft artifact: a rebuilt draft must come with rebuilt heads."""
    from specdecpp.models.identity import model_identity, same_model
    from specdecpp.stopping.head import AcceptanceHead

    identity = "specdecpp-demo-draft@" + demo.artifact_digest(projected.ARTIFACT_DIR)
    assert identity == demo.draft_identity()
    heads = sorted((REPO / "demo" / "heads").glob("wrej*"))
    assert len(heads) == 20
    width = projected.draft_config()["llama_config"]["hidden_size"]
    for h in heads:
        head = AcceptanceHead.from_pretrained(h)
        assert head.draft == identity and head.hidden_size == width
        assert head.meta["target"] == demo.target_identity()
    selection = json.loads((REPO / "demo" / "heads" / "selection.json").read_text())
    assert len(selection["heads"]) == 2 and all((REPO / "demo" / "heads" / s["name"]).is_dir()
                                                for s in selection["heads"])
    # the two lag-free heads: their kind, the draft they name, and their feature size for its width
    from specdecpp.stopping.head import NEXT_FEATURES, NextTokenHead, load_head
    assert len(selection["lag_free_heads"]) == 2
    for s in selection["lag_free_heads"]:
        head = load_head(REPO / "demo" / "heads" / s["name"])
        assert isinstance(head, NextTokenHead) and head.draft == identity and head.hidden_size == width
        assert head.features == NEXT_FEATURES and head.feature_size == 2 * width + 3
        assert 0.0 < float(torch.sigmoid(head(torch.zeros(head.feature_size)).detach())) < 1.0
    # the materialised draft (wherever the cache is) is the model the heads name
    draft_dir = demo.demo_draft_path()
    assert model_identity(str(draft_dir)) == identity
    assert same_model(identity, str(draft_dir)) and same_model(str(draft_dir), identity)
    assert not same_model(identity[:-1] + "0", str(draft_dir))
    assert not same_model(identity, str(demo_cache / "target"))
    # and the resolver the demo registers turns the identities back into the directories
    assert demo.resolve(identity) == draft_dir
    with pytest.raises(LookupError, match="another build"):
        demo.resolve(identity[:-1] + "0")


@pytest.mark.parametrize("part", ["2/2", "1", "0/0", "a/b"])
def test_generate_part_must_name_one_of_n_parts(monkeypatch, part):
    build = load_script("build_draft")
    monkeypatch.setattr(sys, "argv", ["build_draft.py", "generate", "--part", part])
    with pytest.raises(SystemExit, match="--part must be K/N"):
        build.main()
