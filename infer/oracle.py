"""The greedy oracle on a real pair: decode the prompt greedily with the target, then one draft
forward pass over prompt + continuation gives the draft's greedy prediction at every position;
:func:`specdecpp.analysis.potential.greedy_oracle` turns the two into the oracle's counts (no timing)."""

from __future__ import annotations

import torch

from specdecpp import SpeculativeDecoder, TargetOnly
from specdecpp.analysis.potential import greedy_oracle
from specdecpp.core.sampling import SamplingConfig
from specdecpp.models.reduced_vocab import output_vocab_size

from .runner import MethodRunner


@torch.no_grad()
def draft_greedy_predictions(draft, tokens: torch.Tensor, prompt_len: int, vocab: int) -> list[int]:
    """argmax q(. | tokens[:i]) for every generated position i of ``tokens`` [1, L + N]."""
    if tokens.shape[1] <= prompt_len:
        return []
    logits = draft(tokens[:, :-1]).logits[0, prompt_len - 1:, :vocab]
    return logits.argmax(-1).tolist()


class Oracle:
    """The method ``oracle`` (conf/method/oracle.yaml): no settings; greedy decoding only."""

    def check_sampling(self, sampling: SamplingConfig) -> None:
        if not sampling.greedy:
            raise ValueError("method oracle is defined for greedy decoding only: add sampling=greedy")

    def settings(self) -> dict:
        return {}

    def runner(self, draft, target, sampling: SamplingConfig, profile: bool = False) -> OracleRunner:
        return OracleRunner(draft, target, sampling)


class OracleRunner(MethodRunner):
    timed = False  # counts only: the report predicts its throughput with Eq. 2.3

    def __init__(self, draft, target, sampling: SamplingConfig) -> None:
        if not sampling.greedy:
            raise ValueError("the oracle is defined for greedy decoding only: use sampling=greedy")
        self.draft = draft
        self.decoder = SpeculativeDecoder(draft, target, TargetOnly(), sampling)
        self.vocab = min(output_vocab_size(draft), output_vocab_size(target))

    def generate(self, prompt_ids, max_new_tokens, seed, eos_token_id):
        out = self.decoder.generate(prompt_ids, max_new_tokens, eos_token_id=eos_token_id)
        prompt_len = prompt_ids.shape[1]
        target_ids = out.tokens[0, prompt_len:].tolist()
        predictions = draft_greedy_predictions(self.draft, out.tokens, prompt_len, self.vocab)
        return target_ids, greedy_oracle(target_ids, predictions), {}
