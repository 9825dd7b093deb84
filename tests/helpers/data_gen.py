"""The data_gen app in tests: a few prompts in two splits, its Hydra config composed from
overrides, and an independent recomputation of one row's labels."""

from __future__ import annotations

import torch
from hydra import compose, initialize_config_dir

from specdecpp.core.sampling import sample, warp
from specdecpp.data.labels import prompt_generator
from tests.helpers.paths import CONF

PROMPTS = [("t0", "train", "Write a short poem about the sea."),
           ("t1", "train", "Explain how a binary search works, step by step, for a beginner."),
           ("t2", "train", "What is 12 times 7?"),
           ("t3", "train", "def add(a, b):"),
           ("t4", "train", "Give three tips for staying healthy."),
           ("d0", "dev", "The quick brown fox jumps over the lazy dog."),
           ("d1", "dev", "Speculative decoding drafts tokens with a small model.")]


def make_cfg(tiny_pair, prompts_file, out, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("data_gen", overrides=[
            f"pair.draft={tiny_pair.draft}", f"pair.target={tiny_pair.target}", "pair.device=cpu",
            "prompts=jsonl", f"prompts.path={prompts_file}", "splits=[train,dev]", f"out={out}",
            "max_new_tokens=8", "shard_size=2", "batch_size=2", "progress=false", *overrides])


def recompute_row(row, draft, target, sampling, seed, max_new_tokens, eos):
    """A straightforward reference: one full forward per prefix, no cache, no batch, no padding."""
    gen = prompt_generator(seed, row["id"])
    prefix, response = list(row["prompt_ids"]), []
    while len(response) < max_new_tokens and (not response or response[-1] != eos):
        logits = target(torch.tensor([prefix + response])).logits[0, -1]
        response.append(int(sample(warp(logits, sampling), gen)))
    draft_logits = torch.stack([draft(torch.tensor([prefix + response[:i]])).logits[0, -1]
                                for i in range(len(response))])
    target_logits = torch.stack([target(torch.tensor([prefix + response[:i]])).logits[0, -1]
                                 for i in range(len(response))])
    q, p = warp(draft_logits, sampling), warp(target_logits, sampling)
    y = sample(q, gen)
    rows = torch.arange(len(response))
    p_acc = torch.clamp(p[rows, y] / q[rows, y], max=1.0)
    t = sampling.temperature or 1.0
    logq_raw = torch.log_softmax(draft_logits / t, -1)
    return {"target_ids": response, "draft_ids": y.tolist(), "p_acc": p_acc,
            "draft_entropy": -(logq_raw.exp() * logq_raw).sum(-1)}
