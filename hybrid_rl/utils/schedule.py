"""Learning-rate schedules as multipliers of the base LR: linear warm-up, then constant, linear or cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_multiplier(*, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> Callable[[int], float]:
    """f(step) for `torch.optim.lr_scheduler.LambdaLR`; step counts optimizer updates from 0."""

    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * decay

    return f
