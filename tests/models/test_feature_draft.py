"""The feature-conditioned draft (specdecpp.models.feature_draft, EAGLE-3) on tiny Llama targets: shapes;
q exactly zero off the draft vocabulary; the speculators format written as documented and read back
to identical logits (CPU, and a CUDA twin); its own KV cache (incremental = full forward, rollback and
compaction = a fresh forward); load_pair; bad input named; and, where ``speculators`` is importable,
the written checkpoint parsed by its config class and run by its model class to the same logits."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecpp import load_pair
from specdecpp.models.feature_draft import FeatureDraft, FeatureDraftCache, default_aux_layers, is_feature_draft
from specdecpp.models.loading import load_model
from tests.helpers.tiny import tiny_lm

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
VOCAB, HIDDEN, LAYERS = 48, 32, 4
KEPT = list(range(0, VOCAB, 3))  # 16 of 48 ids


@pytest.fixture(scope="module")
def target():
    return tiny_lm(VOCAB, HIDDEN, LAYERS, seed=3, scale=0.4)


def new_draft(target, **kw) -> FeatureDraft:
    kw.setdefault("draft_vocab", KEPT)
    return FeatureDraft.init_from(target, generator=torch.Generator().manual_seed(7), **kw).eval()


@pytest.fixture(scope="module")
def draft(target):
    return new_draft(target)


def features(target, draft, ids):
    with torch.no_grad():
        return draft.fuse(target(ids, output_hidden_states=True).hidden_states)


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    # -inf off the draft vocabulary on both sides; float32 sums in another order move logits by ~1e-6
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    torch.testing.assert_close(a.nan_to_num(neginf=0.0), b.nan_to_num(neginf=0.0), atol=2e-5, rtol=1e-5)


def test_shapes_and_defaults(target, draft):
    assert draft.aux_layers == default_aux_layers(LAYERS) == [0, 2, 3]
    assert default_aux_layers(30) == [2, 15, 27]  # EAGLE-3's, SmolLM2's 30 layers
    ids = tokens(2, 7)
    feats = features(target, draft, ids)
    assert feats.shape == (2, 7, 3 * HIDDEN)
    with torch.no_grad():
        out = draft(ids, features=feats)
        assert out.logits.shape == (2, 7, VOCAB) and out.hidden.shape == (2, 7, HIDDEN)
        last = draft(ids, features=feats, n_logits=2)
        assert last.logits.shape == (2, 2, VOCAB)
        close(last.logits, out.logits[:, -2:])
        step = draft(ids[:, :3], hidden=out.hidden[:, :3])
        assert step.logits.shape == (2, 3, VOCAB)
    assert draft.d2t.dtype == torch.long and draft.t2d.dtype == torch.bool
    assert (torch.arange(len(KEPT)) + draft.d2t).tolist() == KEPT == draft.t2d.nonzero().flatten().tolist()


def test_init_from_copies_the_target(target, draft):
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(draft.lm_head.weight, target.get_output_embeddings().weight[KEPT])
    assert not draft.embed_tokens.weight.requires_grad and not draft.lm_head.weight.requires_grad
    assert draft.fc.weight.requires_grad and draft.layers[0].self_attn.q_proj.in_features == 2 * HIDDEN
    assert new_draft(target, train_lm_head=True).lm_head.weight.requires_grad
    same = new_draft(target)
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), same.state_dict().values(), strict=True))
    layer = draft.spec_config["transformer_layer_config"]
    assert layer["num_key_value_heads"] == 2 and layer["head_dim"] == HIDDEN // 4
    rope = getattr(target.config, "rope_parameters", None) or {"rope_theta": target.config.rope_theta}  # 5.x | 4.x
    assert layer["rope_parameters"]["rope_theta"] == rope["rope_theta"]
    whole = new_draft(target, draft_vocab=None)
    assert whole.draft_vocab_size == VOCAB and bool(whole.t2d.all()) and not bool(whole.d2t.any())


def test_a_scaled_rope_is_copied_from_the_target(tmp_path):
    """A Llama-3-style rope (theta and scaling; transformers 5 holds them as rope_parameters, 4.x as
    rope_theta + rope_scaling): the draft's rotary frequencies are the target's, also after a round trip."""
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=scaling)
    target = LlamaForCausalLM(config).eval()
    draft = FeatureDraft.init_from(target)
    rope = draft.spec_config["transformer_layer_config"]["rope_parameters"]
    assert rope == {**scaling, "rope_theta": 500000.0}
    assert torch.equal(draft.rotary_emb.inv_freq, target.model.rotary_emb.inv_freq)
    draft.save_pretrained(tmp_path)
    assert torch.equal(FeatureDraft.from_pretrained(tmp_path).rotary_emb.inv_freq, target.model.rotary_emb.inv_freq)


def test_q_is_exactly_zero_off_the_draft_vocabulary(target, draft):
    ids = tokens(2, 5, seed=1)
    with torch.no_grad():
        q = torch.softmax(draft(ids, features=features(target, draft, ids)).logits, dim=-1)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[KEPT] = False
    assert bool((q[..., off] == 0).all()) and bool((q[..., KEPT] > 0).all())
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 5))


def test_the_speculators_format_as_documented(draft, tmp_path):
    """config.json and model.safetensors as docs/feature_draft.md (and shared/methods/feature_drafts.md) list them."""
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == len(KEPT) and config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config["target_hidden_size"] is None and config["fc_norm"] is False
    assert all(config[k] is True for k in ("norm_before_residual", "norm_before_fc", "norm_output"))
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == VOCAB and layer["num_hidden_layers"] == 1
    assert set(layer["rope_parameters"]) >= {"rope_type", "rope_theta"}
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    weights = load_file(str(tmp_path / "model.safetensors"))
    h, kv = HIDDEN, 2 * HIDDEN // 4
    shapes = {"d2t": (len(KEPT),), "t2d": (VOCAB,), "embed_tokens.weight": (VOCAB, h), "fc.weight": (h, 3 * h),
              "input_norm.weight": (3 * h,), "layers.0.self_attn.q_proj.weight": (h, 2 * h),
              "layers.0.self_attn.k_proj.weight": (kv, 2 * h), "layers.0.self_attn.v_proj.weight": (kv, 2 * h),
              "layers.0.self_attn.o_proj.weight": (h, h), "layers.0.mlp.gate_proj.weight": (2 * h, h),
              "layers.0.mlp.up_proj.weight": (2 * h, h), "layers.0.mlp.down_proj.weight": (h, 2 * h),
              "layers.0.input_layernorm.weight": (h,), "layers.0.hidden_norm.weight": (h,),
              "layers.0.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
              "lm_head.weight": (len(KEPT), h)}
    assert {k: tuple(v.shape) for k, v in weights.items()} == shapes
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    draft.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert is_feature_draft(tmp_path) and not is_feature_draft(tmp_path / "nope")


@pytest.mark.parametrize("device", DEVICES)
def test_save_load_round_trip_gives_identical_logits(target, draft, tmp_path, device):
    draft.save_pretrained(tmp_path)
    on = copy.deepcopy(target).to(device)
    loaded = FeatureDraft.from_pretrained(tmp_path, target=on)
    assert loaded.device.type == device and loaded.dtype == torch.float32 and not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    mine = copy.deepcopy(draft).to(device)
    ids = tokens(2, 6, seed=2).to(device)
    feats = features(on, mine, ids)
    with torch.no_grad():
        assert torch.equal(loaded(ids, features=feats).logits, mine(ids, features=feats).logits)
    plain = FeatureDraft.from_pretrained(tmp_path)  # no target: CPU, the stored dtype
    assert plain.device.type == "cpu" and torch.equal(plain.token_ids, draft.token_ids)


def test_bfloat16_keeps_the_rotary_frequencies_in_float32(draft):
    half = new_draft_like(draft).to(torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and half.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(half.rotary_emb.inv_freq, draft.rotary_emb.inv_freq)


def new_draft_like(draft) -> FeatureDraft:
    copy = FeatureDraft(draft.spec_config)
    copy.load_state_dict(draft.state_dict())
    copy.set_vocab_map(draft.d2t, draft.t2d)
    return copy.eval()


def test_incremental_decoding_equals_a_full_forward(target, draft):
    ids = tokens(2, 9, seed=3)
    feats = features(target, draft, ids)
    with torch.no_grad():
        full = draft(ids, features=feats)
        cache = draft.new_cache()
        parts = [draft(ids[:, :4], features=feats[:, :4], cache=cache)]
        parts += [draft(ids[:, t : t + 1], features=feats[:, t : t + 1], cache=cache) for t in range(4, 9)]
        assert cache.length == 9
        close(torch.cat([p.logits for p in parts], 1), full.logits)
        close(torch.cat([p.hidden for p in parts], 1), full.hidden)
        # drafting on its own outputs: one step at a time equals a forward over the same hidden inputs
        own = full.hidden
        whole = draft(ids, hidden=own)
        cache = draft.new_cache()
        steps = [draft(ids[:, t : t + 1], hidden=own[:, t : t + 1], cache=cache) for t in range(9)]
        close(torch.cat([s.logits for s in steps], 1), whole.logits)


def test_a_round_rolls_back_and_refeeds_to_what_a_fresh_forward_gives(target, draft):
    """Prefill on target features, draft three tokens on the draft's own outputs, roll back to the
    target's length, feed the target features of the kept positions: as if the draft had read only those."""
    ids = tokens(1, 10, seed=4)
    feats = features(target, draft, ids)
    with torch.no_grad():
        cache = draft.new_cache()
        out = draft(ids[:, :5], features=feats[:, :5], cache=cache)
        hidden, tok = out.hidden[:, -1:], out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            step = draft(tok, hidden=hidden, cache=cache)
            hidden, tok = step.hidden, step.logits.argmax(-1)
        assert cache.length == 8
        cache.rollback(5)
        assert cache.length == 5
        again = draft(ids[:, 5:8], features=feats[:, 5:8], cache=cache)
        fresh = draft(ids[:, :8], features=feats[:, :8])
        close(again.logits, fresh.logits[:, 5:8])
        close(again.hidden, fresh.hidden[:, 5:8])
    cache.rollback(99)
    assert cache.length == 8
    with pytest.raises(ValueError, match="length must be >= 0"):
        cache.rollback(-1)


def test_compaction_and_an_explicit_mask_equal_a_fresh_forward(target, draft):
    ids = tokens(1, 7, seed=5)
    feats = features(target, draft, ids)
    keep = [0, 1, 2, 4]
    with torch.no_grad():
        cache = draft.new_cache()
        draft(ids[:, :6], features=feats[:, :6], cache=cache)
        cache.compact(keep)
        assert cache.length == 4
        nxt = draft(ids[:, 6:], features=feats[:, 6:], position_ids=torch.tensor([[5]]), cache=cache)
        rows = keep + [6]
        fresh = draft(ids[:, rows], features=feats[:, rows], position_ids=torch.tensor([keep + [5]]))
        close(nxt.logits, fresh.logits[:, -1:])
        causal = torch.ones(7, 7, dtype=torch.bool).tril()[None]
        close(draft(ids, features=feats, attention_mask=causal).logits, draft(ids, features=feats).logits)
    with pytest.raises(ValueError, match="compact"):
        cache.compact([2, 1])
    with pytest.raises(ValueError, match="attention_mask must be"):
        draft(ids, features=feats, attention_mask=causal[:, :3])


def test_cache_grows_past_its_first_buffer(target, draft):
    ids = tokens(1, 40, seed=6)
    feats = features(target, draft, ids)
    with torch.no_grad():
        cache = FeatureDraftCache()
        out = [draft(ids[:, :2], features=feats[:, :2], cache=cache)]
        out += [draft(ids[:, t : t + 1], features=feats[:, t : t + 1], cache=cache) for t in range(2, 40)]
        assert cache.keys[0].shape[2] >= 40
        close(torch.cat([o.logits for o in out], 1), draft(ids, features=feats).logits)


def test_load_pair_loads_a_feature_draft_directory(tiny_pair, tmp_path):
    target = load_model(tiny_pair.target, "cpu")
    made = FeatureDraft.init_from(target, generator=torch.Generator().manual_seed(0))
    assert made.spec_config["speculators_config"]["verifier"]["name_or_path"] == tiny_pair.target
    assert made.name_or_path is None and made.config.hidden_size == target.config.hidden_size
    made.save_pretrained(tmp_path / "feature")
    draft, target, tok = load_pair(draft=str(tmp_path / "feature"), target=tiny_pair.target, device="cpu")
    assert isinstance(draft, FeatureDraft) and draft.aux_layers == [0, 1] and len(tok) == tiny_pair.vocab
    assert draft.name_or_path == str(tmp_path / "feature") and draft.dtype == target.dtype
    ids = torch.tensor([tok("Write a poem").input_ids])
    with torch.no_grad():
        feats = draft.fuse(target(ids, output_hidden_states=True).hidden_states)
        assert torch.equal(draft(ids, features=feats).logits, made(ids, features=feats).logits)


def test_a_draft_for_another_target_is_refused(target, draft, tmp_path):
    draft.save_pretrained(tmp_path)
    wider = tiny_lm(VOCAB, 2 * HIDDEN, LAYERS, seed=1)
    with pytest.raises(ValueError, match=r"hidden_size 32 in the draft, 64 in the target"):
        FeatureDraft.from_pretrained(tmp_path, target=wider)
    shallow = tiny_lm(VOCAB, HIDDEN, 3, seed=1)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[0, 2, 3\] need layers \[3\].*3 layers"):
        FeatureDraft.from_pretrained(tmp_path, target=shallow)
    other_vocab = tiny_lm(VOCAB + 8, HIDDEN, LAYERS, seed=1)
    with pytest.raises(ValueError, match=rf"{str(tmp_path)!r}.*vocab_size 48 in the draft.*56 embedding rows"):
        FeatureDraft.from_pretrained(tmp_path, target=other_vocab)
    with pytest.raises(ValueError, match=r"aux_layers must be distinct HF hidden_states ids in \[0, 4\)"):
        FeatureDraft.init_from(target, aux_layers=[1, 4])
    with pytest.raises(ValueError, match=r"draft_vocab must be target ids in \[0, 48\)"):
        FeatureDraft.init_from(target, draft_vocab=[0, 48])
    with pytest.raises(ValueError, match="unknown flags"):
        FeatureDraft.init_from(target, norm_befor_fc=False)


def test_load_pair_refuses_a_feature_draft_for_another_target(tiny_pair, tmp_path):
    FeatureDraft.init_from(tiny_lm(tiny_pair.vocab, 16, 2, seed=1)).save_pretrained(tmp_path / "feature")
    with pytest.raises(ValueError, match=r"hidden_size 16 in the draft, 48 in the target"):
        load_pair(draft=str(tmp_path / "feature"), target=tiny_pair.target, device="cpu")


def rewrite(directory, drop=(), **replace) -> None:
    path = directory / "model.safetensors"
    weights = {k: v for k, v in load_file(str(path)).items() if k not in drop}
    save_file({**weights, **replace}, str(path))


def test_a_checkpoint_without_its_id_mapping_is_refused(target, draft, tmp_path):
    for drop in (["d2t"], ["t2d"], ["d2t", "t2d"]):
        draft.save_pretrained(tmp_path)
        rewrite(tmp_path, drop=drop)
        with pytest.raises(ValueError, match=rf"model.safetensors.*lacks its id mapping \[.*'{drop[0]}'"):
            FeatureDraft.from_pretrained(tmp_path, target=target)
    # a whole-vocabulary draft needs none (speculators writes none then)
    whole = new_draft(target, draft_vocab=None)
    whole.save_pretrained(tmp_path / "whole")
    rewrite(tmp_path / "whole", drop=["d2t", "t2d"])
    assert bool(FeatureDraft.from_pretrained(tmp_path / "whole").t2d.all())


def test_an_inconsistent_id_mapping_is_refused(target, draft, tmp_path):
    draft.save_pretrained(tmp_path)
    t2d = draft.t2d.clone()
    t2d[1] = True  # one id more than d2t maps
    rewrite(tmp_path, t2d=t2d)
    with pytest.raises(ValueError, match=r"model.safetensors.*d2t and t2d disagree: t2d marks 17"):
        FeatureDraft.from_pretrained(tmp_path, target=target)
    d2t = draft.d2t.clone()
    d2t[-1] = 100
    rewrite(tmp_path, d2t=d2t, t2d=draft.t2d.clone())
    with pytest.raises(ValueError, match=r"d2t maps draft ids to target ids i \+ d2t\[i\] that are not distinct"):
        FeatureDraft.from_pretrained(tmp_path, target=target)
    rewrite(tmp_path, d2t=draft.d2t[:-1].clone())
    with pytest.raises(ValueError, match=r"d2t must be integer \[draft_vocab_size\] = \[16\]"):
        FeatureDraft.from_pretrained(tmp_path, target=target)


def test_broken_checkpoints_name_the_file_and_key(target, draft, tmp_path):
    draft.save_pretrained(tmp_path)
    rewrite(tmp_path, drop=["fc.weight"])
    with pytest.raises(ValueError, match=r"model.safetensors.*lacks weights \['fc.weight'\]"):
        FeatureDraft.from_pretrained(tmp_path, target=target)
    draft.save_pretrained(tmp_path)
    rewrite(tmp_path, drop=["embed_tokens.weight"])
    with pytest.raises(ValueError, match="pass target="):
        FeatureDraft.from_pretrained(tmp_path)
    assert torch.equal(FeatureDraft.from_pretrained(tmp_path, target=target).embed_tokens.weight,
                       target.get_input_embeddings().weight)  # taken from the target, as vLLM shares it
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "speculators_model_type": "mtp"}))
    with pytest.raises(ValueError, match=r"config.json.*speculators_model_type 'mtp' is not supported"):
        FeatureDraft.from_pretrained(tmp_path)
    del config["draft_vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json.*draft_vocab_size is missing"):
        FeatureDraft.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="exactly one of features= .* and hidden="):
        draft(tokens(1, 2))
    with pytest.raises(ValueError, match=r"features must be \[B, T, 96\]"):
        draft(tokens(1, 2), features=torch.zeros(1, 2, HIDDEN))


@pytest.fixture(scope="module")
def speculators_pair(tmp_path_factory):
    """A saved tiny target (speculators reads its verifier from disk) and a feature draft written for it."""
    try:
        import speculators.models.eagle3  # noqa: F401
    except ImportError as exc:  # not installed, or a dependency of it missing
        pytest.skip(f"speculators is not importable ({exc}); docs/feature_draft.md gives the install line")
    root = tmp_path_factory.mktemp("speculators")
    tiny_lm(VOCAB, HIDDEN, LAYERS, seed=3, scale=0.4).save_pretrained(root / "target")
    target = load_model(str(root / "target"), "cpu")
    draft = new_draft(target)
    draft.save_pretrained(root / "draft")
    return target, draft, root / "draft"


def test_speculators_parses_the_checkpoint(speculators_pair):
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    target, draft, path = speculators_pair
    config = SpeculatorModelConfig.from_pretrained(str(path))
    assert isinstance(config, Eagle3SpeculatorConfig)
    assert config.draft_vocab_size == len(KEPT) and config.target_vocab_size == VOCAB
    assert config.eagle_aux_hidden_state_layer_ids == draft.aux_layers
    assert config.norm_before_fc and config.norm_before_residual and config.norm_output
    layer = config.transformer_layer_config
    assert layer.hidden_size == HIDDEN and layer.num_key_value_heads == 2 and layer.head_dim == HIDDEN // 4
    assert config.speculators_config.verifier.name_or_path == str(path.parent / "target")


# speculators 0.9.0 (made for transformers <= 5.19) passes past_key_values, which 5.2x deprecates: its call, not ours
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_speculators_model_gives_the_same_logits(speculators_pair):
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel

    target, draft, path = speculators_pair
    config = SpeculatorModelConfig.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "sdpa"
    theirs = Eagle3DraftModel.from_pretrained(str(path), config=config).eval()
    assert torch.equal(theirs.d2t, draft.d2t) and torch.equal(theirs.t2d, draft.t2d)
    seen = []
    theirs.lm_head.register_forward_hook(lambda module, args, out: seen.append(out))
    ids = tokens(1, 9, seed=8)
    feats = features(target, draft, ids)
    with torch.no_grad():
        # speculators' trainer counts positions from 1 (its data shift); RoPE is relative, so ours from 0 agree
        theirs(hidden_states=feats, input_ids=ids, document_ids=torch.zeros_like(ids),
               position_ids=torch.arange(1, 10)[None], ttt_steps=1)
        ours = draft(ids, features=feats).logits
    torch.testing.assert_close(ours[..., draft.token_ids], seen[0], atol=2e-5, rtol=1e-5)


def unrolled_case(n_layers: int, device):
    """A tiny target, a perturbed ``init_from`` draft of it over every other id, and 2 x 9 tokens."""
    target = tiny_lm(64, 48, 4, seed=3)
    draft = FeatureDraft.init_from(target, draft_vocab=torch.arange(0, 64, 2), num_layers=n_layers,
                                   generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    return target.to(device), draft.to(device), tokens.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_layers", [1, 2])
def test_unrolled_equals_drafting_with_a_cache(n_layers, device):
    """FeatureDraft.unrolled (training-time test, data_gen's labels at depth k) at every step and
    anchor computes what drafting after that prefix with a cache computes: the hidden state fed on
    and the logits."""
    target, draft, tokens = unrolled_case(n_layers, device)
    with torch.no_grad():
        feats = draft.fuse(target(tokens, output_hidden_states=True).hidden_states)
        steps = draft.unrolled(tokens, feats, steps=3)
        for i in (0, 3, 5):  # anchor i: prefix x_0..x_{i+1}, target features g_0..g_i
            cache = draft.new_cache()
            out = draft(tokens[:, 1:i + 2], features=feats[:, :i + 1], cache=cache, n_logits=1)
            hidden = out.hidden[:, -1:]
            for k in range(3):
                if k:
                    if i + 1 + k >= tokens.shape[1]:
                        break
                    out = draft(tokens[:, i + 1 + k:i + 2 + k], hidden=hidden, cache=cache)
                hidden = out.hidden[:, -1:]
                torch.testing.assert_close(steps[k].hidden[:, i], hidden[:, 0])
                torch.testing.assert_close(draft.full_logits(draft.lm_head(steps[k].normed[:, i])), out.logits[:, -1],
                                           atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_layers", [1, 2])
def test_unrolled_probes_give_the_state_after_feeding_a_candidate(n_layers, device):
    """``unrolled(probes=...)``: each step's ``after`` at anchor i is the state the draft computes when,
    after drafting k+1 tokens after x_0..x_{i+1} with a cache, it feeds the probe (a candidate other
    than the true next token) on that step's output: what the paper's head reads for that candidate.
    The probes leave the steps themselves unchanged."""
    target, draft, tokens = unrolled_case(n_layers, device)
    probes = torch.randint(0, 64, (2, 8, 3), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        feats = draft.fuse(target(tokens, output_hidden_states=True).hidden_states)
        plain = draft.unrolled(tokens, feats, steps=3)
        steps = draft.unrolled(tokens, feats, steps=3, probes=probes)
        for k in range(3):
            assert plain[k].after is None
            torch.testing.assert_close(steps[k].hidden, plain[k].hidden)
        for i in (0, 3, 7):
            cache = draft.new_cache()
            out = draft(tokens[:, 1:i + 2], features=feats[:, :i + 1], cache=cache, n_logits=1)
            hidden = out.hidden[:, -1:]
            for k in range(3):
                if k:
                    if i + 1 + k >= tokens.shape[1]:
                        break
                    out = draft(tokens[:, i + 1 + k:i + 2 + k], hidden=hidden, cache=cache)
                hidden = out.hidden[:, -1:]
                length = cache.length
                fed = draft(probes[:, i, k:k + 1], hidden=hidden, cache=cache)
                cache.rollback(length)
                torch.testing.assert_close(steps[k].after[:, i], fed.hidden[:, 0], atol=1e-4, rtol=1e-4)
                if k < 2 and i + 2 + k < tokens.shape[1]:  # the probe differs from the true token: another state
                    assert not torch.allclose(steps[k].after[:, i], steps[k + 1].hidden[:, i], atol=1e-3)
    with pytest.raises(ValueError, match=r"probes must be \[B, L-1, steps\]"):
        draft.unrolled(tokens, feats, steps=2, probes=probes)
