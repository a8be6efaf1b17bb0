"""Dynamic sampling (DAPO): keep only groups whose rewards differ, over as many rollout rounds as it takes.

Each round is generated, scored and filtered on its own; the kept samples of all rounds are then
renumbered into one batch (uids 0..N-1 in round order), identically on every rank because the
decision depends only on the scores, which every rank has.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hybrid_rl.algos import groups_with_signal
from hybrid_rl.types import BatchIndex, Rollout, Scores


def keep_mask(index: BatchIndex, scores: Scores) -> torch.Tensor:
    """[N] bool: samples of groups with signal (not every reward of the group equal)."""
    return groups_with_signal(scores.total, index.groups)


def merge_rounds(rounds: list[tuple[Rollout, Scores, torch.Tensor]], limit: int) -> tuple[Rollout, Scores]:
    """The kept samples of every round, at most `limit` of them in whole groups, renumbered 0..N-1."""
    held, indices, scores = [], [], []
    offset = 0
    for rollout, scored, keep in rounds:
        new_uid = torch.cumsum(keep.long(), 0) - 1 + offset
        held += [s.renumbered(int(new_uid[s.uid])) for s in rollout.held if keep[s.uid]]
        indices.append(rollout.index.select(keep.nonzero().flatten()))
        scores.append(_select(scored, keep))
        offset += int(keep.sum())
    index = BatchIndex(*(torch.cat([getattr(i, f) for i in indices]) for f in
                         ("prompt_lens", "response_lens", "groups", "truncated")),
                       _parts([i.parts if i.parts is not None else torch.zeros(i.size, dtype=torch.int64)
                               for i in indices]),
                       None if all(i.model_lens is None for i in indices) else torch.cat([i.own_lens for i in indices]))
    total = _concat(scores)
    size = _whole_groups(index.groups, limit)
    keep_first = torch.arange(index.size) < size
    return Rollout([s for s in held if s.uid < size], index.select(keep_first.nonzero().flatten())), \
        _select(total, keep_first)


def _parts(parts: list[torch.Tensor]) -> torch.Tensor | None:
    joined = torch.cat(parts)
    return joined if bool(joined.any()) else None


def _whole_groups(groups: torch.Tensor, limit: int) -> int:
    """The largest count <= limit that ends at a group boundary (groups are contiguous runs)."""
    if groups.numel() <= limit:
        return int(groups.numel())
    boundary = limit
    while boundary > 0 and groups[boundary - 1] == groups[boundary]:
        boundary -= 1
    return boundary


def _select(s: Scores, keep: torch.Tensor) -> Scores:
    return replace(s, total=s.total[keep], parts={k: v[keep] for k, v in s.parts.items()})


def _concat(parts: list[Scores]) -> Scores:
    first = parts[0]
    return Scores(torch.cat([p.total for p in parts]), {k: torch.cat([p.parts[k] for p in parts]) for k in first.parts},
                  sum(p.errors for p in parts), sum(p.timeouts for p in parts), sum(p.seconds for p in parts))
