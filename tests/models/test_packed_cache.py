"""specdecpp.fast.torch_internals, ``packed_cache`` (off by default): inductor's FX graph cache keys
oneDNN-packed weights by their values.
A packed weight's key is its shape, dtype and the digest of its values (recomputed here from the weight
before packing); inside the block the cache's check lets packed tensors through, outside it skips the
graph as inductor does; the originals are back after the block, also after an error; and (slow) a graph
compiled with packed weights is saved, loaded again for a model with the same weights, and not loaded
for a model of the same shapes with other weights, whose output stays its own."""

from __future__ import annotations

import copy
import hashlib
import inspect

import pytest
import torch
from torch._inductor import codecache

from specdecpp.fast import torch_internals
from specdecpp.fast.step import own_code
from specdecpp.fast.torch_internals import ENV, enabled, packed_key, packed_weights_cacheable

pack = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
needs_mkldnn = pytest.mark.skipif(pack is None or not torch.backends.mkldnn.is_available()
                                  or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                  reason="this torch or CPU packs no bf16 weight for oneDNN")


def current():
    return (inspect.getattr_static(codecache.CacheabilityValidator, "check_tensor"),
            inspect.getattr_static(codecache.FxGraphCachePickler, "_reduce_tensor"))


def pickler():
    return codecache.FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))


def packed(seed: int, shape=(48, 32), dtype=torch.bfloat16):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return w, pack(w, None)


@needs_mkldnn
def test_key_is_shape_dtype_and_a_digest_of_the_values():
    w, p = packed(0)
    assert p.is_mkldnn
    digest = hashlib.blake2b(w.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    assert packed_key(p) == ("mkldnn", (48, 32), "torch.bfloat16", digest)
    assert packed_key(packed(0)[1]) == packed_key(p)  # the same values: the same key
    assert packed_key(packed(1)[1]) != packed_key(p)  # other values
    changed = w.clone()
    changed[47, 31] = changed[47, 31] + 1  # one value
    assert packed_key(pack(changed, None)) != packed_key(p)


@needs_mkldnn
def test_packed_tensors_pass_the_check_and_reach_the_key_only_inside():
    _, p = packed(0)
    before = current()
    with pytest.raises(codecache.BypassFxGraphCache, match="mkldnn"):
        codecache.CacheabilityValidator.check_tensor(p)
    with packed_weights_cacheable(True):
        assert current() != before
        codecache.CacheabilityValidator.check_tensor(p)  # no bypass
        fn, args = pickler()._reduce_tensor(p)
        assert fn(*args) == packed_key(p)
        dense = torch.randn(3, 4)  # other tensors: inductor's own reducer (values of a small constant)
        assert pickler()._reduce_tensor(dense)[1][0].values == dense.tolist()
        with packed_weights_cacheable(True):  # nested: patched once, still patched after the inner block
            pass
        codecache.CacheabilityValidator.check_tensor(p)
    assert current() == before


@needs_mkldnn
def test_a_packed_tensor_that_cannot_be_digested_skips_the_cache(monkeypatch):
    def fails(t):
        raise RuntimeError("no dense form")

    monkeypatch.setattr(torch_internals, "packed_key", fails)
    with packed_weights_cacheable(True), pytest.raises(codecache.BypassFxGraphCache, match="mkldnn"):
        pickler()._reduce_tensor(packed(0)[1])


def test_off_by_default_opted_in_and_restored_after_an_error(monkeypatch):
    before = current()
    with packed_weights_cacheable(False):
        assert current() == before
    monkeypatch.delenv(ENV, raising=False)
    assert not enabled("packed_cache")  # off by default
    with packed_weights_cacheable():
        assert current() == before
    monkeypatch.setenv(ENV, "packed_cache")
    assert enabled("packed_cache")
    with packed_weights_cacheable():
        assert current() != before
    with pytest.raises(RuntimeError, match="inside"), packed_weights_cacheable(True):
        assert current() != before
        raise RuntimeError("inside")
    assert current() == before


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 48))
    return model.eval().to(torch.bfloat16)


@needs_mkldnn
@pytest.mark.slow
def test_cached_for_the_same_weights_and_not_for_others(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold cache of this test's own
    options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)

    def compiled(model, name: str, on: bool = True):
        """The model compiled as a first compile (a code object of its own), its output and the cache's
        counters of that compile."""
        def run(x):
            return model(x)

        before = dict(counters["inductor"])
        step = own_code(run, "packed_cache")  # one name: a graph's key holds its names
        with torch.no_grad(), inductor_config.patch(freezing=True, fx_graph_cache=True), packed_weights_cacheable(on):
            out = torch.compile(step, fullgraph=True, dynamic=False, options=options)(x)
        return out, {k: counters["inductor"][k] - before.get(k, 0)
                     for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}

    a, b = mlp(0), mlp(1)
    with torch.no_grad():
        eager_a, eager_b = a(x), b(x)
    out_off, seen = compiled(a, "off", on=False)
    if not seen["fxgraph_cache_bypass"]:
        pytest.skip("inductor cached this graph without the patch (no packed weight stayed in it on this CPU)")
    out_a, seen = compiled(a, "a")
    assert seen == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1, "fxgraph_cache_bypass": 0}
    torch.testing.assert_close(out_a, eager_a, rtol=2e-2, atol=2e-2)
    out_b, seen = compiled(b, "b")  # the same shapes, other weights: not a's compiled graph
    assert seen == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1, "fxgraph_cache_bypass": 0}
    torch.testing.assert_close(out_b, eager_b, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(out_b, out_a, atol=0.1)
    out_a2, seen = compiled(copy.deepcopy(a), "a2")  # another object with a's weights: loaded from the cache
    assert seen == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 0}
    assert torch.equal(out_a2, out_a)
    assert torch.equal(out_off, out_a)
