import json
import shutil

import pytest
import torch

from specdecpp import FixedK, SamplingConfig, SpeculativeDecoder, load_pair
from tests.helpers.paths import REPO
from tests.helpers.tiny import build_tokenizer, tiny_lm


def test_load_pair_from_local_directories(tiny_pair):
    draft, target, tok = load_pair(tiny_pair.draft, tiny_pair.target, device="cpu")
    assert draft.config.hidden_size == 32 and target.config.hidden_size == 48
    assert len(tok) == tiny_pair.vocab
    assert not draft.training and not any(p.requires_grad for p in target.parameters())
    assert draft.dtype == torch.float32  # auto on CPU


def test_missing_model_path_names_the_path(tiny_pair, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_pair(str(tmp_path / "nope"), tiny_pair.target)
    with pytest.raises(FileNotFoundError, match="GGUF"):
        load_pair(tiny_pair.draft, str(tmp_path / "model.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pair(str(tmp_path / "empty"), tiny_pair.target)


def test_mismatched_tokenizers_are_refused(tiny_pair, tmp_path):
    other = tmp_path / "other_draft"
    shutil.copytree(tiny_pair.draft, other)
    # same size, two token ids swapped: only the token-to-id map differs
    tok_file = other / "tokenizer.json"
    data = json.loads(tok_file.read_text())
    vocab = data["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="token-to-id maps differ"):
        load_pair(str(other), tiny_pair.target)


def test_vocab_size_mismatch_is_refused(tmp_path):
    tok = build_tokenizer()
    for name, vocab in (("small", len(tok) - 10), ("ok", len(tok))):
        tiny_lm(vocab, 32, 1).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(ValueError, match="vocabularies disagree"):
        load_pair(str(tmp_path / "small"), str(tmp_path / "ok"))


def test_target_padded_beyond_tokenizer_is_fine(tmp_path):
    """A target whose output layer is padded (e.g. to a multiple of 64) still decodes losslessly."""
    tok = build_tokenizer()
    for name, vocab, seed in (("draft", len(tok), 1), ("target", len(tok) + 64, 2)):
        tiny_lm(vocab, 32, 1, seed=seed).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    draft, target, tok = load_pair(str(tmp_path / "draft"), str(tmp_path / "target"), device="cpu")
    ids = torch.tensor([tok("Write a poem").input_ids])
    out = SpeculativeDecoder(draft, target, FixedK(3), SamplingConfig(temperature=0)).generate(ids, 12)
    # reference: the target's greedy decoding restricted to the tokenizer's vocabulary
    ref = ids
    for _ in range(12):
        logits = target(ref).logits[0, -1, : len(tok)]
        ref = torch.cat([ref, logits.argmax().view(1, 1)], 1)
    assert out.tokens.tolist() == ref.tolist()


# transformers APIs the code calls, with the release that introduced each (checked against the
# 4.55.4 and 4.56.0 wheels: 4.55 has neither `dtype=` in from_pretrained, where it is silently
# ignored and the model loads in float32, nor a `config` argument to DynamicCache).
TRANSFORMERS_APIS = {"from_pretrained(dtype=)": "4.56.0", "DynamicCache(config=)": "4.56.0",
                     "forward(logits_to_keep=)": "4.50.0"}


def test_transformers_lower_bound_covers_the_apis_used(tiny_pair):
    import inspect
    import re

    import transformers
    from packaging.version import Version
    from transformers import DynamicCache

    from specdecpp.models.loading import load_model

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in deps["dependencies"] if re.match(r"transformers\b", d)]
    lower = Version(re.search(r">=\s*([\d.]+)", spec).group(1))
    assert lower >= max(Version(v) for v in TRANSFORMERS_APIS.values()), spec
    assert Version(transformers.__version__) >= lower
    # the installed version has them (and they do what the code relies on)
    assert "config" in inspect.signature(DynamicCache.__init__).parameters
    assert load_model(tiny_pair.draft, "cpu", dtype="bfloat16").dtype == torch.bfloat16
