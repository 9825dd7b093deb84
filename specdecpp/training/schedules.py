"""Learning-rate schedules, one home for every training loop of the project (the acceptance head's
in train/, a draft's distillation in scripts/)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.0, warmup_offset: int = 0) -> float:
    """The factor of the base learning rate at ``step``: a linear warm-up over ``warmup`` steps,
    ``(step + warmup_offset) / warmup``, then a cosine decay from 1 to ``floor`` at ``total``
    (transformers' cosine schedule with ``floor=0`` and ``warmup_offset=0``)."""
    if step < warmup:
        return (step + warmup_offset) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
