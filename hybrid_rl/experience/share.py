"""This rank's training share: units balanced over ranks by tokens, then the tokens of its units sent to it.

A unit is what must be trained together: one sample, or for preference objectives one (chosen,
rejected) pair. Units, not samples, are balanced over ranks and cut into mini- and micro-batches,
so a pair is never split and every pair is trained exactly once per epoch. The assignment is a
pure function of the `BatchIndex` (and the scores, for online DPO's pairs), so every rank computes
the same one without talking; then one exchange moves each unit's tokens from the rank that holds
them to the rank that trains them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_rl.algos.pairs import best_worst_pairs
from hybrid_rl.data import balance_units
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.rollout.exchange import send_to_owners
from hybrid_rl.types import BatchIndex, Rollout, Sample


@dataclass(frozen=True)
class Share:
    """This rank's training samples, unit by unit (a pair's chosen row first), with the step's index."""

    samples: list[Sample]
    rows: torch.Tensor  # [B] long: each sample's uid (its row in the step's N)
    index: BatchIndex
    paired: bool
    num_units: int  # of all ranks: samples, or pairs

    @property
    def size(self) -> int:
        return len(self.samples)


def singles(index: BatchIndex) -> list[list[int]]:
    return [[u] for u in range(index.size)]


def groups(index: BatchIndex, world: int) -> list[list[int]]:
    """Prefix sharing: each group's samples as one unit, so that they land on one rank and are packed with their
    prompt once (`trainer.prefix_share`); singles where there are fewer groups than ranks (a rank would get none)."""
    out: dict[int, list[int]] = {}
    for u, g in enumerate(index.groups.tolist()):
        out.setdefault(g, []).append(u)
    return list(out.values()) if len(out) >= world else singles(index)


def adjacent_pairs(index: BatchIndex) -> list[list[int]]:
    """Offline DPO: rows (2k, 2k + 1) are record k's (chosen, rejected)."""
    return [[u, u + 1] for u in range(0, index.size, 2)]


def ranked_pairs(index: BatchIndex, scores: torch.Tensor) -> list[list[int]]:
    """Online DPO: each group's best and worst sample by reward (groups whose rewards all tie give none); of a black-box
    agent's episode stitched into several samples, only its last (the one judged) is a candidate."""
    ends = index.episode_ends.nonzero().flatten()
    return ends[best_worst_pairs(scores[ends], index.groups[ends])].tolist()


def assign(units: list[list[int]], index: BatchIndex, world: int) -> tuple[list[list[int]], torch.Tensor]:
    """(units of each rank, owner rank of every uid or -1 when no unit has it): token-balanced, the same on all ranks."""
    lengths = index.lengths.tolist()
    per_rank = balance_units([sum(lengths[u] for u in unit) for unit in units], world)
    owner = torch.full((index.size,), -1, dtype=torch.int64)
    for rank, mine in enumerate(per_rank):
        for k in mine:
            owner[units[k]] = rank
    return [[units[k] for k in mine] for mine in per_rank], owner


def make_share(rollout: Rollout, units: list[list[int]], dims: ParallelDims, *, paired: bool,
               fields_of: Callable[[int], Mapping[str, Any]]) -> Share:
    """Collective: this rank's units, their samples received from the ranks that hold them."""
    per_rank, owner = assign(units, rollout.index, dims.world)
    received = {s.uid: s for s in send_to_owners(rollout.held, owner, dims.world, fields_of)}
    order = [uid for unit in per_rank[dims.rank] for uid in unit]
    return Share([received[u] for u in order], torch.tensor(order, dtype=torch.long), rollout.index, paired,
                 len(units))
