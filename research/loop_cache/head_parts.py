"""The lag-free head's per-candidate score in parts (the twenty-first session's note to experiment 11):
the policy's whole ``should_stop``, the features alone, the MLP through its modules, and the same MLP
as bare ``F.linear`` calls (bit for bit the modules' output, checked), warm and right after a 16 MB
flush (about what a draft forward leaves) and a 256 MB one (a target forward). Random draft-shaped
inputs, the demo draft's embedding; needs the demo pair; about a minute.

    SPECDECPP_CACHE=.cache PYTHONPATH=. python research/loop_cache/head_parts.py
"""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdecpp.stopping.head import load_head
from specdecpp.stopping.policies import SpecDecPP

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from demo_pair import demo_pair_bf16  # noqa: E402 (beside this file)
from loop_alone import median_us  # noqa: E402


def main() -> None:
    draft, _, _ = demo_pair_bf16()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(draft.config.hidden_size, generator=g).to(torch.bfloat16)
    logits = (3 * torch.randn(draft.config.vocab_size, generator=g)).to(torch.bfloat16)
    token = torch.tensor(int(logits.float().argmax()))
    policy = SpecDecPP(load_head("demo/heads/next_wrej1_d1"), 0.5, max_candidates=3)
    policy.bind(draft, 1.0)
    head = policy.head
    feats = head.features_of(hidden, logits, token)

    def whole():
        policy.begin_round(0)
        return policy.should_stop(1, logits, hidden, token)

    def features():
        return head.features_of(hidden, logits, token)

    def mlp():
        return head(feats)

    def mlp_functional():  # the same arithmetic without nn.Module's call machinery
        x = feats.to(head.out.weight.dtype)
        x = F.linear(x, head.proj.weight, head.proj.bias)
        for block in head.blocks:
            x = x + F.silu(F.linear(x, block.linear.weight, block.linear.bias))
        return F.linear(x, head.out.weight, head.out.bias).squeeze(-1)

    if not torch.equal(mlp(), mlp_functional()):
        raise RuntimeError("the bare F.linear MLP differs from the head's modules")
    print(f"head depth {head.depth}, features {head.features}")
    for mb in (16, 256):
        flush = np.ones(mb * 2**18, np.float32)
        for name, fn in (("should_stop", whole), ("features", features), ("MLP, modules", mlp),
                         ("MLP, F.linear", mlp_functional)):
            warm, cold = median_us(fn, flush, 60, False), median_us(fn, flush, 60, True)
            print(f"{name}: warm {warm:.0f} us, after a {mb} MB flush {cold:.0f} us")


if __name__ == "__main__":
    main()
