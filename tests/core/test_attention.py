"""Every decoder's forwards run under ``decode_attention``: on CUDA not cuDNN's attention kernel,
which builds a plan per new query/key length (docs/gpu.md, "Fixed K on CUDA")."""

import contextlib

import pytest
import torch

from infer import hf_assisted
from specdecpp import (
    SVIP,
    Cascade,
    FixedK,
    PEARLDecoder,
    SamplingConfig,
    SequoiaDecoder,
    SpeculativeDecoder,
    TokenTree,
)
from specdecpp.core import attention
from specdecpp.core.attention import SDPA_ENV, decode_attention
from specdecpp.fast import torch_internals
from tests.helpers.paths import REPO
from tests.helpers.tiny import tiny_lm

FLAGS = ("cudnn_sdp_enabled", "flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled")


def flags() -> dict:
    return {f: getattr(torch.backends.cuda, f)() for f in FLAGS}


def test_cuda_decoding_turns_cudnn_attention_off_and_restores_it(monkeypatch):
    monkeypatch.delenv(SDPA_ENV, raising=False)
    before = flags()
    assert before["cudnn_sdp_enabled"]  # PyTorch's default, which the test relies on
    with decode_attention("cuda"):
        inside = flags()
    assert inside == {**before, "cudnn_sdp_enabled": False}
    assert flags() == before


def test_cpu_and_the_default_choice_leave_the_kernels_alone(monkeypatch):
    before = flags()
    with decode_attention("cpu"):
        assert flags() == before
    monkeypatch.setenv(SDPA_ENV, "default")
    with decode_attention(torch.device("cuda")):
        assert flags() == before


def test_a_bad_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv(SDPA_ENV, "cudnn")
    with pytest.raises(ValueError, match=SDPA_ENV):
        decode_attention("cuda")


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(16, 32, 1, seed=1, scale=0.5), tiny_lm(16, 32, 2, seed=2, scale=0.5)


def _decode(kind: str, draft, target):
    sampling = SamplingConfig(temperature=1.0)
    ids = torch.tensor([[1, 2, 3]])
    gen = torch.Generator().manual_seed(0)
    if kind == "chain":
        return SpeculativeDecoder(draft, target, SVIP(0.3, max_candidates=3), sampling).generate(ids, 6, gen)
    if kind == "batch":
        return SpeculativeDecoder(draft, target, FixedK(2), sampling).generate_batch([ids[0], ids[0, :2]], 6)
    if kind == "cascade":
        return SpeculativeDecoder(draft, target, FixedK(2), sampling, cascade=Cascade("opt", 0.2)).generate(ids, 6, gen)
    if kind == "pearl":
        return PEARLDecoder(draft, target, gamma=2, sampling=sampling).generate(ids, 6, gen)
    if kind == "sequoia":
        return SequoiaDecoder(draft, target, TokenTree([-1, -1, 0]), sampling).generate(ids, 6, gen)
    if kind == "hf_assisted":
        runner = hf_assisted.HFAssistedRunner(draft, target, sampling, "constant", 2)
        return runner.generate(ids, 6, 0, None)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["chain", "batch", "cascade", "pearl", "sequoia", "hf_assisted"])
def test_every_forward_of_every_decoder_runs_under_decode_attention(monkeypatch, pair, kind):
    """A spy in place of decode_attention: each forward of either model (PEARL's drafting thread
    included) must find it open, on the decoder's device."""
    draft, target = pair
    state = {"open": 0, "devices": set(), "outside": 0, "forwards": 0}

    @contextlib.contextmanager
    def spy(device):
        state["devices"].add(torch.device(device).type)
        state["open"] += 1
        try:
            yield
        finally:
            state["open"] -= 1

    def hook(module, args, kwargs):
        state["forwards"] += 1
        state["outside"] += state["open"] == 0

    monkeypatch.setattr(attention, "decode_attention", spy)
    monkeypatch.setattr(hf_assisted, "decode_attention", spy)
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in (draft, target)]
    try:
        _decode(kind, draft, target)
    finally:
        for h in handles:
            h.remove()
    assert state["forwards"] > 0 and state["outside"] == 0, state
    assert state["devices"] == {"cpu"}


@pytest.mark.gpu
def test_cuda_decoding_launches_no_cudnn_attention(monkeypatch):
    """On CUDA (fp16, where PyTorch would pick cuDNN's kernel on recent GPUs), the profiler sees no
    cuDNN attention in a decode."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.delenv(SDPA_ENV, raising=False)
    draft = tiny_lm(64, 64, 1, seed=1, scale=0.5).to("cuda", torch.float16)
    target = tiny_lm(64, 128, 2, seed=2, scale=0.5, heads=2).to("cuda", torch.float16)
    decoder = SpeculativeDecoder(draft, target, FixedK(3), SamplingConfig(temperature=1.0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = decoder.generate(torch.tensor([[1, 2, 3]], device="cuda"), 12, torch.Generator().manual_seed(0))
    names = {e.key for e in prof.key_averages()}
    assert out.stats.n_generated == 12
    assert "aten::scaled_dot_product_attention" in names or any("attention" in n for n in names)
    assert not any("cudnn_attention" in n for n in names), sorted(n for n in names if "attention" in n)


def test_profile_rounds_compares_methods_that_do_the_same_work(tmp_path):
    """scripts/profile_rounds.py on tiny random models: every method decodes the tokens asked for,
    and FixedK as shipped and FixedK declaring reads_values run the same rounds and drafts (the
    premise of its comparison); --phases splits the host time by engine call."""
    import json
    import subprocess
    import sys

    from transformers import LlamaConfig

    for name, hidden, layers in (("draft", 32, 1), ("target", 48, 2)):
        LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2).to_json_file(tmp_path / f"{name}.json")
    script = REPO / "scripts" / "profile_rounds.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cpu", "--dtype", "float32", "--configs",
                          str(tmp_path), "--ks", "1,3", "--new", "6", "--repeats", "1", "--prompt-len", "5",
                          "--phases", "--json", str(tmp_path / "rows.json")],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {r["method"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert set(rows) == {"target_only", "fixed_k1", "fixed_k1_values", "svip_k1", "fixed_k3", "fixed_k3_values",
                         "svip_k3"}
    assert all(r["tokens"] == 6 for r in rows.values())
    assert rows["target_only"]["rounds"] == 6 and rows["target_only"]["drafted"] == 0
    for k in (1, 3):
        same = [(rows[m]["rounds"], rows[m]["drafted"]) for m in (f"fixed_k{k}", f"fixed_k{k}_values", f"svip_k{k}")]
        assert same[0] == same[1] == same[2], same
    assert "host ms per round inside each call" in out and "target_feed" in out


@pytest.mark.parametrize("batch,q,length", [(1, 1, 37), (2, 3, 64), (1, 8, 9)])
def test_the_cpu_attention_equals_sdpa(batch, q, length):
    """``cpu_attention`` (the static runners' attention on a CPU): grouped-query heads over an
    additive 4-D mask give sdpa's output (float32, to rounding), and in bf16 sdpa's to bf16's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    g = torch.Generator().manual_seed(batch * 100 + q)
    heads, kv_heads, dim = 6, 2, 16
    query = torch.randn(batch, heads, q, dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=g) for _ in range(2))
    seen = torch.rand(batch, 1, q, length, generator=g) < 0.7
    seen[..., 0] = True  # every query sees something
    mask = torch.zeros(seen.shape).masked_fill_(~seen, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = heads // kv_heads, False, False
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ref, _ = sdpa(module, query, key, value, mask, scaling=0.3)
    out, weights = attention.cpu_attention(module, query, key, value, mask, scaling=0.3)
    assert weights is None and out.shape == ref.shape == (batch, q, heads, dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    half = [t.bfloat16() for t in (query, key, value)]
    out16, _ = attention.cpu_attention(module, *half, mask.bfloat16(), scaling=0.3)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), ref, rtol=0.02, atol=0.02)


def test_static_runners_use_the_cpu_attention_only_inside_their_forwards():
    """A static runner's forward on a CPU runs ``cpu_attention`` in place of sdpa, and the model is on
    sdpa again after it: the eager runner of the same model never runs it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from specdecpp.fast.runners import StaticRunner
    from specdecpp.models.runner import ModelRunner

    model = tiny_lm(64, 32, 2, seed=3, scale=0.5)
    assert model.config._attn_implementation == "sdpa"
    assert attention._cpu_attention_registered()
    calls = []
    real = ALL_ATTENTION_FUNCTIONS[attention.CPU_ATTENTION]
    ALL_ATTENTION_FUNCTIONS[attention.CPU_ATTENTION] = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        ids = torch.tensor([1, 5, 9, 2])
        static = StaticRunner(model, 64, False, fast="static", max_len=32)
        static_logits, _ = static.feed(ids, n_logits=4)
        assert len(calls) == 2 and model.config._attn_implementation == "sdpa"  # one call per layer
        eager_logits, _ = ModelRunner(model, 64, False).feed(ids, n_logits=4)
        assert len(calls) == 2
    finally:
        ALL_ATTENTION_FUNCTIONS[attention.CPU_ATTENTION] = real
    torch.testing.assert_close(static_logits, eager_logits, rtol=1e-4, atol=1e-4)
    with attention.static_attention(model.config, "cuda"):  # elsewhere: no change
        assert model.config._attn_implementation == "sdpa"


def test_the_swap_a_runner_enters_writes_the_config_dict_and_restores_it(monkeypatch):
    """``attention_swap`` (what a static runner enters around each forward) on a Llama config, made
    cheaper by ``torch_internals.swap_by_dict`` (``config_dict``, on by default): the instance-dict
    swap, read back through the config's own attribute; nested entries, an error inside and a model
    on another attention leave the config as it was; off a CPU nothing is swapped; with the piece
    off, the public setter (:func:`static_attention`)."""
    monkeypatch.delenv(torch_internals.ENV, raising=False)
    model = tiny_lm(64, 32, 2, seed=3, scale=0.5)
    config = model.config
    public = attention.attention_swap(config, "cpu")
    assert public.func is attention.static_attention
    swap = torch_internals.swap_by_dict(public, config)
    assert swap.func is torch_internals.SwapStored  # this transformers keeps the choice in the instance dict
    for entered in (swap, public):
        with entered():
            assert config._attn_implementation == attention.CPU_ATTENTION
            with entered():  # a forward inside another runner's forward
                assert config._attn_implementation == attention.CPU_ATTENTION
            assert config._attn_implementation == attention.CPU_ATTENTION
        assert config._attn_implementation == "sdpa"
        with pytest.raises(KeyError), entered():
            raise KeyError("inside the forward")
        assert config._attn_implementation == "sdpa"
        config._attn_implementation = "eager"  # switched after the runner was built: left alone
        with entered():
            assert config._attn_implementation == "eager"
        assert config._attn_implementation == "eager"
        config._attn_implementation = "sdpa"
    assert attention.attention_swap(config, "cuda") is contextlib.nullcontext
    assert torch_internals.swap_by_dict(contextlib.nullcontext, config) is contextlib.nullcontext
    monkeypatch.setenv(torch_internals.ENV, "-config_dict")
    assert torch_internals.swap_by_dict(public, config) is public


def test_a_config_with_sub_configs_swaps_through_its_attribute():
    """Where the config has sub-configs (whose setter the dict write would skip) or keeps the
    choice elsewhere, the swap goes through ``config._attn_implementation`` (static_attention)."""
    from transformers import LlamaConfig

    class Composite(LlamaConfig):
        sub_configs = {"text_config": LlamaConfig}

    config = Composite(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2)
    config.text_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    swap = torch_internals.swap_by_dict(attention.attention_swap(config, "cpu"), config)
    assert swap.func is attention.static_attention
    with swap():
        assert config._attn_implementation == config.text_config._attn_implementation == attention.CPU_ATTENTION
    assert config._attn_implementation == config.text_config._attn_implementation == "sdpa"
    del config.__dict__[torch_internals.STORED]  # a transformers that stores it elsewhere
    assert not torch_internals.stored_directly(config)
