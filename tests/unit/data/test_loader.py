"""PromptLoader: deterministic order, reshuffle per epoch with seed + epoch, exact resume from state_dict."""

from __future__ import annotations

import json
from itertools import islice

import pytest
import torch

from hybrid_rl.data import PromptLoader

RECORDS = list(range(10))  # any sequence works as a dataset; ints make the order easy to read


def _take(loader: PromptLoader, steps: int) -> list[list[int]]:
    return list(islice(loader, steps))


def test_the_same_seed_gives_the_same_batches_and_another_seed_others():
    first = _take(PromptLoader(RECORDS, 4, seed=3), 7)
    assert first == _take(PromptLoader(RECORDS, 4, seed=3), 7)
    assert first != _take(PromptLoader(RECORDS, 4, seed=4), 7)


def test_epoch_e_is_a_permutation_drawn_with_seed_plus_e():
    loader = PromptLoader(RECORDS, 5, seed=11, drop_last=False)
    epochs = [sum(_take(loader, 2), []) for _ in range(3)]
    for e, order in enumerate(epochs):
        assert order == torch.randperm(10, generator=torch.Generator().manual_seed(11 + e)).tolist()
    assert epochs[0] != epochs[1]  # reshuffled each epoch


def test_drop_last_skips_the_partial_tail_and_moves_to_the_next_epoch():
    loader = PromptLoader(RECORDS, 4, seed=0)
    assert loader.num_batches_per_epoch == 2
    batches = _take(loader, 2)
    assert [len(b) for b in batches] == [4, 4]
    assert loader.epoch == 1  # rolled over right after the epoch's last full batch
    assert loader.state_dict()["position"] == 0


def test_without_drop_last_the_last_batch_is_short_and_every_record_is_seen_once():
    loader = PromptLoader(RECORDS, 4, seed=0, drop_last=False)
    batches = _take(loader, 3)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(sum(batches, [])) == RECORDS
    assert loader.epoch == 1


def test_without_shuffle_every_epoch_keeps_file_order():
    loader = PromptLoader(RECORDS, 5, seed=0, shuffle=False)
    assert _take(loader, 4) == [RECORDS[:5], RECORDS[5:]] * 2


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5])  # mid-epoch, at an epoch boundary, in a later epoch
def test_a_resumed_loader_replays_exactly_the_uninterrupted_batches(stop_after):
    uninterrupted = _take(PromptLoader(RECORDS, 3, seed=7), 8)

    before = PromptLoader(RECORDS, 3, seed=7)
    seen = _take(before, stop_after)
    state = json.loads(json.dumps(before.state_dict()))  # plain ints and bools: survives any checkpoint format
    after = PromptLoader(RECORDS, 3, seed=7)
    after.load_state_dict(state)
    assert after.epoch == before.epoch
    assert seen + _take(after, 8 - stop_after) == uninterrupted


def test_resuming_with_other_settings_is_refused():
    state = PromptLoader(RECORDS, 3, seed=7).state_dict()
    with pytest.raises(ValueError, match="batch_size: saved 3, now 4"):
        PromptLoader(RECORDS, 4, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="num_records: saved 10, now 9"):
        PromptLoader(RECORDS[:9], 3, seed=7).load_state_dict(state)


def test_a_dataset_smaller_than_one_batch_is_refused_at_construction():
    with pytest.raises(ValueError, match="fewer than one batch of 16"):
        PromptLoader(RECORDS, 16, seed=0)
    assert len(next(PromptLoader(RECORDS, 16, seed=0, drop_last=False))) == 10
