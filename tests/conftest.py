"""Shared fixtures: tiny random Llama models and a tiny byte-level tokenizer, all built offline.

- ``tiny_lm(vocab, hidden, layers, seed)`` builds one model in memory.
- ``tiny_models``: a (draft, target) pair over an 8-token vocabulary, for exact enumeration.
- ``tiny_pair``: draft and target saved as ordinary HF directories with a shared tokenizer
  (chat template, EOS); hidden sizes differ (draft 32, target 48). Use ``tiny_pair.draft`` and
  ``tiny_pair.target`` as paths wherever a model path is expected.
"""

from __future__ import annotations

import types

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test runs torch on one thread (the suite's one place for this): tiny models are
    dominated by per-op overhead, and extra threads only add contention (10-20x slower on a
    loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "Write a short poem about the sea.", "Explain how a binary search works.",
    "def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
    "What is 12 times 7? Let us think step by step.", "Give three tips for staying healthy.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
] * 20


def tiny_lm(vocab: int, hidden: int = 32, layers: int = 1, seed: int = 0, scale: float = 0.3,
            heads: int = 4):
    """A random LlamaForCausalLM. ``scale`` sets the init std: larger gives peakier, more varied
    next-token distributions, which makes draft/target disagreement interesting."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                      max_position_embeddings=512, initializer_range=scale, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    return model.float().eval().requires_grad_(False)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tiny_models():
    """(draft, target) over 8 tokens: draft 1 layer, target 2 layers, different seeds."""
    return tiny_lm(8, 32, 1, seed=1, scale=0.6), tiny_lm(8, 32, 2, seed=2, scale=0.6)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Draft and target saved as HF directories sharing one tokenizer."""
    root = tmp_path_factory.mktemp("tiny_pair")
    tok = build_tokenizer()
    vocab = len(tok)
    paths = {}
    for name, hidden, layers, seed in (("draft", 32, 1, 11), ("target", 48, 2, 12)):
        model = tiny_lm(vocab, hidden, layers, seed=seed, scale=0.15)
        model.config.eos_token_id = tok.eos_token_id
        model.config.bos_token_id = tok.bos_token_id
        model.config.pad_token_id = tok.pad_token_id
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        paths[name] = str(d)
    return types.SimpleNamespace(draft=paths["draft"], target=paths["target"], tokenizer=tok,
                                 draft_hidden=32, target_hidden=48, vocab=vocab, root=root)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
