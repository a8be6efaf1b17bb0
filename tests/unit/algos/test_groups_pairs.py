"""Group ids, episodes, DAPO dynamic-sampling filter, online-DPO pairs."""

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import best_worst_pairs, group_index, groups_with_signal
from hybrid_rl.algos.estimators import AdvantageInputs, AdvantageSettings, get_estimator
from hybrid_rl.algos.groups import episode_rows


def test_group_index_numbers_by_first_appearance_for_lists_and_tensors():
    inverse, num = group_index(["b", "a", "b", ("c", 1)])
    assert num == 3 and inverse.tolist() == [0, 1, 0, 2]
    inverse, num = group_index(torch.tensor([9, 2, 9, 5]))
    assert num == 3 and inverse.tolist() == [0, 1, 0, 2]


def test_group_index_rejects_2d_tensors():
    with pytest.raises(ValueError, match="1-D"):
        group_index(torch.zeros(2, 2))


def test_groups_with_signal():
    # groups a = [1, 1] (all equal), b = [0, 1] (signal), c = [2, 2] (all equal), d = [3] (one sample)
    keep = groups_with_signal(torch.tensor([1, 1, 0, 1, 2, 2, 3]), list("aabbccd"))
    assert keep.tolist() == [False, False, True, True, False, False, False]


def test_grouped_functions_reject_mismatched_lengths():
    with pytest.raises(ValueError, match="3 group ids for 2 scores"):
        groups_with_signal(torch.tensor([1.0, 2.0]), [0, 0, 1])


SCORES = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.0, 2.0, 1.0, 0.0, 1.0])
IDS = ["a", "b", "a", "c", "a", "b", "d", "d", "a"]


@pytest.mark.parametrize("group_ids", [IDS, torch.tensor([5, 9, 5, 1, 5, 9, 2, 2, 5])], ids=["list", "tensor"])
def test_best_worst_pairs(group_ids):
    # a = samples {0, 2, 4, 8} with [0.5, 1, 0, 1]: best is the first 1.0 (index 2), worst index 4
    # b = {1, 5} with [2, 2]: all equal, no pair;  c = {3}: one sample, no pair
    # d = {6, 7} with [1, 0]: (6, 7). Pairs in order of each group's first appearance: a, d.
    assert_close(best_worst_pairs(SCORES, group_ids), torch.tensor([[2, 4], [6, 7]]))


def test_best_worst_pairs_none():
    pairs = best_worst_pairs(torch.tensor([1.0, 1.0, 2.0]), [0, 0, 1])
    assert pairs.shape == (0, 2) and pairs.dtype == torch.long


def test_episode_rows_are_each_episodes_last_sample():
    last, inverse = episode_rows(torch.tensor([0, 1, 1, 2, 2, 2]))
    assert last.tolist() == [0, 2, 5] and inverse.tolist() == [0, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_estimators_count_an_episode_once_however_many_samples_it_is(name):
    """Two groups of three episodes; episode 1 is three samples, episode 4 two: every sample gets its episode's
    advantage, the one it would have as a single sample."""
    scores, groups = torch.tensor([1.0, 0.0, 2.0, 5.0, 3.0, 1.0]), torch.tensor([0, 0, 0, 1, 1, 1])
    whole = get_estimator(name)(AdvantageInputs(scores, groups, torch.arange(6), torch.ones(6, 2)),
                                AdvantageSettings())[0]
    episode = torch.tensor([0, 1, 1, 1, 2, 3, 4, 4, 5])
    split = AdvantageInputs(scores[episode], groups[episode], torch.arange(9), torch.ones(9, 2), episodes=episode)
    assert_close(get_estimator(name)(split, AdvantageSettings())[0], whole[episode])
    # without the episodes, the three copies of episode 1 would pull its group's mean toward it
    plain = AdvantageInputs(scores[episode], groups[episode], torch.arange(9), torch.ones(9, 2))
    assert not torch.allclose(get_estimator(name)(plain, AdvantageSettings())[0], whole[episode])
