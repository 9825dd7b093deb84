"""The setting the study's micro-benchmarks share: one torch thread, autograd off, and the demo pair
(``make demo-pair``) loaded on the CPU in bf16."""

from __future__ import annotations

import torch

from specdecpp.models.loading import load_pair


def demo_pair_bf16():
    """(draft, target, tokenizer) of the demo pair, after setting one thread and no autograd."""
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    from specdecpp_demo import demo_draft_path, demo_target_path

    return load_pair(str(demo_draft_path()), str(demo_target_path()), device="cpu", dtype="bfloat16")
