"""Micro-batches under a token budget, and equal-count, equal-token shards across data-parallel ranks."""

from __future__ import annotations

import logging
import math
import random

import pytest

from hybrid_rl.data import balance_across_ranks, split_by_token_budget


def _random_lengths(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(16, 512) for _ in range(n)]


def _sums(groups: list[list[int]], lengths: list[int]) -> list[int]:
    return [sum(lengths[i] for i in group) for group in groups]


def test_long_and_short_sequences_pair_up_to_fill_the_budget():
    # Longest first: 8 and 7 open a micro-batch each, then 3 joins the lighter (7) and 2 joins 8.
    assert split_by_token_budget([8, 2, 7, 3], max_tokens=10) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_tokens", [600, 1024, 4096])
def test_micro_batches_cover_every_index_once_fit_the_budget_and_are_few(seed, max_tokens):
    lengths = _random_lengths(seed, 64)
    groups = split_by_token_budget(lengths, max_tokens)

    assert sorted(sum(groups, [])) == list(range(64))
    assert all(total <= max_tokens for total in _sums(groups, lengths))
    # First-fit-decreasing uses at most 11/9 OPT + 1 bins, and OPT >= total / budget.
    assert len(groups) <= math.ceil(11 / 9 * math.ceil(sum(lengths) / max_tokens)) + 1
    assert groups == split_by_token_budget(lengths, max_tokens)  # deterministic
    assert all(group == sorted(group) for group in groups)


def test_micro_batches_are_even_when_the_budget_leaves_room():
    lengths = _random_lengths(0, 64)
    sums = _sums(split_by_token_budget(lengths, 4096), lengths)
    assert max(sums) - min(sums) <= 512  # at most one sequence apart, not a full bin and a near-empty one


def test_a_sequence_over_the_budget_gets_its_own_micro_batch_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="hybrid_rl.data.batching"):
        groups = split_by_token_budget([3, 50, 4, 3], max_tokens=10)
    assert groups == [[0, 2, 3], [1]]
    assert "max_tokens=10" in caplog.text and "longest 50" in caplog.text


def test_min_micro_batches_forces_more_micro_batches_for_lockstep_ranks():
    lengths = _random_lengths(1, 32)
    natural = split_by_token_budget(lengths, 4096)
    forced = split_by_token_budget(lengths, 4096, min_micro_batches=len(natural) + 3)
    assert len(forced) == len(natural) + 3
    assert sorted(sum(forced, [])) == list(range(32))
    assert all(total <= 4096 for total in _sums(forced, lengths))


def test_min_micro_batches_splits_tight_bins_when_even_ones_would_overflow():
    # Budget 10: FFD gives [6, 4], [6, 4]; the even 3-way split would need a bin over 10.
    lengths = [6, 6, 4, 4]
    groups = split_by_token_budget(lengths, 10, min_micro_batches=3)
    assert len(groups) == 3 and all(total <= 10 for total in _sums(groups, lengths))


def test_no_sequences_give_no_micro_batches_and_too_many_are_refused():
    assert split_by_token_budget([], 10) == []
    with pytest.raises(ValueError, match="min_micro_batches=3 for 2 sequences"):
        split_by_token_budget([1, 2], 10, min_micro_batches=3)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_ranks_get_equal_counts_and_nearly_equal_tokens(seed, world):
    lengths = _random_lengths(seed, 256)
    groups = balance_across_ranks(lengths, world)

    assert len(groups) == world
    assert all(len(group) == 256 // world for group in groups)
    assert sorted(sum(groups, [])) == list(range(256))
    sums = _sums(groups, lengths)
    # Karmarkar-Karp lands within a few tokens here; a contiguous split is off by thousands.
    assert max(sums) - min(sums) <= 16
    assert groups == balance_across_ranks(lengths, world)  # every rank computes the same answer


def test_one_sequence_per_rank_and_one_rank_are_trivial():
    assert balance_across_ranks([7, 3, 5], 3) == [[0], [1], [2]]
    assert balance_across_ranks([7, 3, 5], 1) == [[0, 1, 2]]


def test_a_count_not_divisible_by_the_world_size_is_refused():
    with pytest.raises(ValueError, match="10 sequences cannot be split equally across 4 ranks"):
        balance_across_ranks([1] * 10, 4)
