"""A model together with what trains it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Model:
    """An (FSDP-sharded) module with its optimizer and LR schedule; both None when the model is frozen."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
