"""Tiny random models and a tiny byte-level tokenizer, all built offline (the fixtures in
tests/conftest.py build their pairs from these).

- ``tiny_lm(vocab, hidden, layers, seed)`` builds one model in memory.
- ``build_tokenizer()``: a byte-level BPE tokenizer with a chat template and EOS.
- ``noisy_copy(model, noise, seed)``: a draft that agrees with the target often but not always.
- ``ConstantHead(hidden, logit)``, ``ConstantNext(hidden, logit)``: a paper head and a lag-free head
  predicting the same logit everywhere; ``random_next_head(hidden, depth, seed)``: a seeded lag-free head.
"""

from __future__ import annotations

import copy

import torch

from specdecpp import AcceptanceHead, NextTokenHead

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


def noisy_copy(model, noise: float, seed: int):
    """A draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    return draft


class ConstantHead(AcceptanceHead):
    """A head predicting the same acceptance logit everywhere."""

    def __init__(self, hidden_size, logit):
        super().__init__(hidden_size, depth=0)
        with torch.no_grad():
            self.out.weight.zero_()
            self.out.bias.fill_(logit)


class ConstantNext(NextTokenHead):
    """A lag-free head predicting the same acceptance logit everywhere."""

    def __init__(self, hidden_size, logit):
        super().__init__(hidden_size, depth=0)
        with torch.no_grad():
            self.out.weight.zero_()
            self.out.bias.fill_(logit)


def random_next_head(hidden: int, depth: int, seed: int) -> NextTokenHead:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return NextTokenHead(hidden, depth)


def perturbed_feature_draft(target, scale: float = 0.05):
    """``FeatureDraft.init_from(target)`` (seed 0) with every parameter moved by ``scale`` times a
    fixed normal draw (seeded by its size), so its q differs from the target's in a reproducible way."""
    import torch

    from specdecpp.models.feature_draft import FeatureDraft

    draft = FeatureDraft.init_from(target, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return draft
