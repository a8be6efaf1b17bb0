"""Per-turn rewards under GAE (issue 43, item 8), by hand: a two-turn response (model, tool result, model) whose first
turn earned 0.5 from the environment and whose outcome (final 1.0 plus that 0.5) is 1.5."""

import pytest
import torch

from hybrid_rl.algos.advantages import gae_unwhitened
from hybrid_rl.algos.estimators import AdvantageInputs, AdvantageSettings, get_estimator
from hybrid_rl.algos.shaping import token_rewards, turn_reward_tokens

MASK = torch.tensor([[1, 1, 0, 0, 1, 1]], dtype=torch.bool)  # turn 1: tokens 0-1; tool result: 2-3; turn 2: 4-5
SCORE = torch.tensor([1.5])


def test_each_turns_reward_sits_on_its_last_token_and_the_rest_of_the_score_at_the_end():
    turns = turn_reward_tokens(MASK, [[0.5, 0.0]])
    assert turns.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 0.0]]
    rewards = token_rewards(SCORE, MASK, turn_rewards=turns)
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 1.0]]
    assert rewards.sum().item() == pytest.approx(1.5)  # the outcome estimators' sum is unchanged
    # a row whose runs do not match its turns keeps its whole score at the end
    assert turn_reward_tokens(MASK, [[0.5, 0.0, 0.2]]).abs().sum() == 0


def test_gae_returns_are_per_turn():
    rewards = token_rewards(SCORE, MASK, turn_rewards=turn_reward_tokens(MASK, [[0.5, 0.0]]))
    zero = torch.zeros(1, 6)
    # gamma 0.5, lam 1, V = 0: A_5 = 1; A_4 = 0.5 * 1 = 0.5; A_1 = 0.5 + 0.5 * 0.5 = 0.75 (the tool result is
    # skipped); A_0 = 0.5 * 0.75 = 0.375. The second turn's tokens do not get the first turn's 0.5.
    adv, _ = gae_unwhitened(rewards, zero, MASK, 0.5, 1.0)
    assert adv[0].tolist() == pytest.approx([0.375, 0.75, 0.0, 0.0, 0.5, 1.0])
    # all at the end (no per-turn rewards): 1.5, 0.75, 0.375, 0.1875
    adv, _ = gae_unwhitened(token_rewards(SCORE, MASK), zero, MASK, 0.5, 1.0)
    assert adv[0].tolist() == pytest.approx([0.1875, 0.375, 0.0, 0.0, 0.75, 1.5])
    # gamma 1, lam 0.5, V = [0.2, 0.4, -, -, 0.6, 0.8]: delta_5 = 1 - 0.8 = 0.2, A_5 = 0.2; delta_4 = 0.8 - 0.6 = 0.2,
    # A_4 = 0.2 + 0.5 * 0.2 = 0.3; delta_1 = 0.5 + 0.6 - 0.4 = 0.7, A_1 = 0.7 + 0.5 * 0.3 = 0.85;
    # delta_0 = 0.4 - 0.2 = 0.2, A_0 = 0.2 + 0.5 * 0.85 = 0.625; returns = A + V
    values = torch.tensor([[0.2, 0.4, 9.0, 9.0, 0.6, 0.8]])
    adv, ret = gae_unwhitened(rewards, values, MASK, 1.0, 0.5)
    assert adv[0].tolist() == pytest.approx([0.625, 0.85, 0.0, 0.0, 0.3, 0.2])
    assert ret[0].tolist() == pytest.approx([0.825, 1.25, 0.0, 0.0, 0.9, 1.0])


def test_the_gae_estimator_reads_the_turn_rewards():
    values = torch.tensor([[0.2, 0.4, 9.0, 9.0, 0.6, 0.8]])
    turns = turn_reward_tokens(MASK, [[0.5, 0.0]])
    x = AdvantageInputs(SCORE, torch.tensor([0]), torch.tensor([0]), MASK.float(), values=values, turn_rewards=turns)
    _, ret = get_estimator("gae")(x, AdvantageSettings(gamma=1.0, lam=0.5))
    assert ret[0].tolist() == pytest.approx([0.825, 1.25, 0.0, 0.0, 0.9, 1.0])
    plain = AdvantageInputs(SCORE, torch.tensor([0]), torch.tensor([0]), MASK.float(), values=values)
    _, ret = get_estimator("gae")(plain, AdvantageSettings(gamma=1.0, lam=0.5))
    # without them, 1.5 at the end: A_5 = 0.7, A_4 = 0.2 + 0.5 * 0.7 = 0.55, A_1 = 0.2 + 0.5 * 0.55 = 0.475,
    # A_0 = 0.2 + 0.5 * 0.475 = 0.4375; returns = A + V
    assert ret[0].tolist() == pytest.approx([0.6375, 0.875, 0.0, 0.0, 1.15, 1.5])


def test_the_batch_places_a_samples_turn_rewards_only_when_its_outcome_includes_them():
    from hybrid_rl.experience.batch import loss_mask, per_turn_rewards
    from hybrid_rl.rollout.trajectory import Trajectory

    def sample(fields):
        t = Trajectory([7, 8])
        t.add_model([1, 2], [-0.1, -0.1])
        t.add_context([3, 4])
        t.add_model([5, 6], [-0.1, -0.1])
        return t.to_sample(0, 0, 0, fields)

    rewarded = sample({"turn_rewards": [0.5, 0.0], "env_reward": 1.5})
    mask = loss_mask([rewarded, sample({"turn_rewards": [0.5, 0.0]})], 6)  # the second: no environment reward
    assert per_turn_rewards([rewarded, sample({"turn_rewards": [0.5, 0.0]})], mask).tolist() == [
        [0.0, 0.5, 0.0, 0.0, 0.0, 0.0], [0.0] * 6]
    assert per_turn_rewards([sample({"turn_rewards": [0.0, 0.0], "env_reward": 1.0})], mask[:1]) is None
