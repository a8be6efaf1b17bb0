"""Per-group statistics over samples that share a prompt (GRPO, RLOO, DAPO filtering, online DPO), and episodes.

`group_ids` are any hashable ids, as a list (or other sequence) or as a 1-D tensor; samples with
equal ids form a group. They are mapped once to contiguous ints (`group_index`) so that group
sums are one `index_add` instead of a Python loop over samples.

An *episode* is one request's samples: usually one, but a black-box agent's episode can be stitched into several
trajectories, each a sample. Group statistics count episodes, not samples (`episode_rows`): an episode that split
into more pieces must not weigh more in its group.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

GroupIds = Sequence[Hashable] | Tensor


def group_index(group_ids: GroupIds, *, device: torch.device | str | None = None) -> tuple[Tensor, int]:
    """Map ids to contiguous group numbers `0..G-1`, numbered in order of first appearance.

    Returns `(inverse [B] long, G)` with `inverse[i]` the group number of sample `i`. Lists and tensors
    get the same numbering, so results ordered by group do not depend on how ids were passed.
    """
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        _, inverse = torch.unique(group_ids, return_inverse=True)
        num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
        # torch.unique numbers groups by sorted id; renumber by first appearance.
        positions = torch.arange(inverse.numel(), device=inverse.device)
        first = torch.full((num_groups,), inverse.numel(), device=inverse.device, dtype=torch.long)
        first = first.scatter_reduce(0, inverse, positions, "amin")
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(num_groups, device=inverse.device)
        return rank[inverse].to(device), num_groups
    numbers: dict[Hashable, int] = {}
    # One dict lookup per sample is unavoidable for arbitrary hashables; all maths after it is vectorised.
    inverse_list = [numbers.setdefault(g, len(numbers)) for g in group_ids]
    return torch.tensor(inverse_list, dtype=torch.long, device=device), len(numbers)


def group_moments(scores: Tensor, group_ids: GroupIds) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-group count, mean and unbiased variance of `scores [B]`.

    Returns `(inverse [B], count [G], mean [G], var [G])`. A one-sample group has variance 0 here
    (undefined as `0/0`); callers that need other conventions (GRPO's std 1) apply them.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    inverse, num_groups = group_index(group_ids, device=scores.device)
    if inverse.numel() != scores.numel():
        raise ValueError(f"got {inverse.numel()} group ids for {scores.numel()} scores")
    count = torch.bincount(inverse, minlength=num_groups).to(scores.dtype)
    mean = scores.new_zeros(num_groups).index_add(0, inverse, scores) / count
    deviation = scores - mean[inverse]
    squared = scores.new_zeros(num_groups).index_add(0, inverse, deviation * deviation)
    var = squared / (count - 1).clamp_min(1)
    return inverse, count, mean, var


def group_max_min(scores: Tensor, group_ids: GroupIds) -> tuple[Tensor, Tensor, Tensor]:
    """Return `(inverse [B], max [G], min [G])` of `scores [B]` per group."""
    inverse, num_groups = group_index(group_ids, device=scores.device)
    if inverse.numel() != scores.numel():
        raise ValueError(f"got {inverse.numel()} group ids for {scores.numel()} scores")
    # include_self=False: the zeros are placeholders, every group has at least one sample.
    empty = scores.new_zeros(num_groups)
    group_max = empty.scatter_reduce(0, inverse, scores, "amax", include_self=False)
    group_min = empty.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    return inverse, group_max, group_min


def groups_with_signal(scores: Tensor, group_ids: GroupIds) -> Tensor:
    """DAPO dynamic sampling: bool `[B]`, True for samples whose group's scores are not all equal.

    A group where every sample got the same score has zero group-relative advantage and so adds no
    gradient, only noise in the token count; one-sample groups are dropped for the same reason.
    """
    inverse, group_max, group_min = group_max_min(scores, group_ids)
    return (group_max != group_min)[inverse]


def episode_rows(episode_ids: GroupIds) -> tuple[Tensor, Tensor]:
    """Episodes' representative rows: `(last [E] long, inverse [B] long)`, the last sample of each episode (the one
    its outcome was judged on) and each sample's episode number `0..E-1` (by first appearance)."""
    inverse, num_episodes = group_index(episode_ids)
    positions = torch.arange(inverse.numel(), device=inverse.device)
    last = torch.full((num_episodes,), -1, dtype=torch.long, device=inverse.device)
    return last.scatter_reduce(0, inverse, positions, "amax"), inverse
