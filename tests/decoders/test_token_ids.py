"""Issue 64 row 8: a prompt id outside the models' vocabulary is refused by the decoders' shared
input check (``specdecpp.decoders.rounds.check_token_ids``) with the bad id, its position and the
vocabulary sizes, before any forward (it was an embedding's ``IndexError: index out of range in self``)."""

from __future__ import annotations

import pytest
import torch

from specdecpp import (
    FixedK,
    PEARLDecoder,
    SamplingConfig,
    SequoiaDecoder,
    SpeculativeDecoder,
    TokenTree,
)
from tests.helpers.tiny import tiny_lm

GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def models():
    """A draft of 8 tokens and a target of 10: the smaller vocabulary bounds the ids."""
    return tiny_lm(8, 32, 1, seed=1), tiny_lm(10, 32, 1, seed=2)


DECODERS = {
    "chain": lambda d, t: SpeculativeDecoder(d, t, policy=FixedK(2), sampling=GREEDY),
    "pearl": lambda d, t: PEARLDecoder(d, t, 2, GREEDY),
    "sequoia": lambda d, t: SequoiaDecoder(d, t, TokenTree.chain(2), GREEDY),
}


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("bad, pos", [(8, 2), (-1, 0)])
def test_token_id_outside_the_vocabulary_is_named(models, name, bad, pos):
    prompt = torch.tensor([[1, 2, 3]])
    prompt[0, pos] = bad
    decoder = DECODERS[name](*models)
    with pytest.raises(ValueError) as err:
        decoder.generate(prompt, 3)
    assert str(err.value) == (
        f"prompt_ids[0, {pos}] = {bad} is not a token id of the models: ids run 0..7 (vocabulary sizes: draft 8, "
        "target 10); 1 id(s) of prompt_ids are outside it. Tokenize the prompt with the pair's tokenizer")


def test_batch_names_the_row_and_position(models):
    decoder = DECODERS["chain"](*models)
    with pytest.raises(ValueError, match=r"^prompts\[1\]\[3\] = 9 is not a token id of the models: ids run 0\.\.7 "
                                         r"\(vocabulary sizes: draft 8, target 10\); 2 id\(s\)"):
        decoder.generate_batch([torch.tensor([1, 2]), torch.tensor([1, 2, 3, 9, 12])], 3)


def test_float_ids_and_ids_inside_pass(models):
    decoder = DECODERS["chain"](*models)
    with pytest.raises(ValueError, match="prompt_ids must hold integer token ids .* got dtype torch.float32"):
        decoder.generate(torch.tensor([[1.0, 2.0]]), 3)
    out = decoder.generate(torch.tensor([[0, 7]]), 3)  # both ends of the shared range
    assert out.tokens[0, :2].tolist() == [0, 7]
