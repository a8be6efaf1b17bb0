"""Online DPO: preference pairs from groups of scored samples of the same prompt."""

from __future__ import annotations

import torch
from torch import Tensor

from .groups import GroupIds, group_max_min


def best_worst_pairs(scores: Tensor, group_ids: GroupIds) -> Tensor:
    """One `(chosen, rejected)` pair per group: its best and worst sample, as indices into the batch.

    Groups whose scores are all equal (including one-sample groups) carry no preference and give no
    pair. Ties for best or worst go to the first such sample. Pairs are ordered by each group's first
    appearance in `group_ids`.

    Returns:
        long tensor `[P, 2]`, columns `(chosen_index, rejected_index)`; `[0, 2]` when no group qualifies.
    """
    inverse, group_max, group_min = group_max_min(scores, group_ids)
    num_samples = scores.shape[0]
    positions = torch.arange(num_samples, device=scores.device)
    # First index of the max (min) per group: min over positions, with non-max samples pushed past the end.
    no_index = torch.full_like(group_max, num_samples, dtype=torch.long)
    is_best = scores == group_max[inverse]
    is_worst = scores == group_min[inverse]
    best = no_index.scatter_reduce(0, inverse, torch.where(is_best, positions, num_samples), "amin")
    worst = no_index.scatter_reduce(0, inverse, torch.where(is_worst, positions, num_samples), "amin")
    has_preference = group_max != group_min
    return torch.stack([best[has_preference], worst[has_preference]], dim=1)
