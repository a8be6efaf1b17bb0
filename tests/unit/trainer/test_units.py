"""Preference pairs are units: balanced over ranks, cut into mini- and micro-batches, never split or dropped.

Pure bookkeeping, checked for many world sizes and token budgets in one process: `assign` gives each
rank whole units, `split_units` whole units per mini-batch, `micro_batches` whole units per micro-batch,
and every pair lands exactly once. (The gradients of the same path on FSDP ranks are checked in
`test_units_fsdp.py`.)
"""

import pytest
import torch

from hybrid_rl.experience.share import adjacent_pairs, assign, groups, ranked_pairs, singles
from hybrid_rl.model.forward import micro_batches
from hybrid_rl.types import BatchIndex
from hybrid_rl.updates import split_units
from tests.unit.trainer.samples import make_sample


def _index(response_lens: list[int], groups: list[int] | None = None) -> BatchIndex:
    n = len(response_lens)
    return BatchIndex(torch.full((n,), 30), torch.tensor(response_lens), torch.tensor(groups or list(range(n))),
                      torch.zeros(n, dtype=torch.bool))


def _responses(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(200, 1201, (n,), generator=g).tolist()  # 200-1200-token responses, as in the report


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("budget", [1, 2048, 8192, 10**6])
@pytest.mark.parametrize("mini_batches", [1, 3])
def test_every_pair_is_trained_exactly_once_whole_per_epoch(world, budget, mini_batches):
    index = _index(_responses(64))  # 32 pairs
    units = adjacent_pairs(index)
    per_rank, owner = assign(units, index, world)
    trained = []
    for rank, mine in enumerate(per_rank):
        assert all(owner[u] == rank for unit in mine for u in unit)
        rows = [u for unit in mine for u in unit]
        samples = [make_sample(k, [1] * 30, [2] * int(index.response_lens[u])) for k, u in enumerate(rows)]
        for mini in split_units([[2 * k, 2 * k + 1] for k in range(len(mine))], mini_batches):
            local = [i for unit in mini for i in unit]
            renumbered = [[2 * k, 2 * k + 1] for k in range(len(mini))]
            for mb in micro_batches([samples[i] for i in local], budget, units=renumbered):
                assert len(mb.indices) % 2 == 0 and all(mb.indices[j + 1] == mb.indices[j] + 1
                                                        for j in range(0, len(mb.indices), 2))
                trained += [tuple(rows[local[mb.indices[j]]] for j in (p, p + 1))
                            for p in range(0, len(mb.indices), 2)]
    assert sorted(trained) == [tuple(u) for u in units]  # each pair once, chosen before rejected


def test_ranks_get_token_balanced_counts_that_differ_by_at_most_one():
    index = _index(_responses(10))
    per_rank, owner = assign(adjacent_pairs(index), index, 3)  # 5 pairs on 3 ranks
    assert sorted(len(m) for m in per_rank) == [1, 2, 2]
    assert sorted(owner.tolist()) == sorted(r for r, m in enumerate(per_rank) for _ in range(2 * len(m)))


def test_online_pairs_are_best_against_worst_of_each_group_that_has_signal():
    index = _index([5] * 8, groups=[0, 0, 0, 0, 1, 1, 1, 1])
    scores = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.3, 0.3, 0.3, 0.3])
    assert ranked_pairs(index, scores) == [[1, 0]]  # group 1 ties: no pair
    per_rank, owner = assign(ranked_pairs(index, scores), index, 2)
    assert owner.tolist() == [0, 0, -1, -1, -1, -1, -1, -1]  # unpaired samples go nowhere


def test_single_units_cover_every_sample():
    index = _index(_responses(7))
    per_rank, owner = assign(singles(index), index, 4)
    assert sorted(u for m in per_rank for unit in m for u in unit) == list(range(7))
    assert (owner >= 0).all()


def test_prefix_sharing_puts_each_group_on_one_rank_and_falls_back_to_singles_with_fewer_groups_than_ranks():
    index = _index(_responses(12), groups=[0, 1, 2] * 4)  # a group's samples need not be adjacent
    assert groups(index, 3) == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    per_rank, owner = assign(groups(index, 2), index, 2)
    assert all(len(set(owner[[g, g + 3, g + 6, g + 9]].tolist())) == 1 for g in range(3))
    assert groups(index, 4) == singles(index)
