"""Token rewards from outcome scores, and DAPO's overlong penalty."""

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import gae, overlong_penalty, token_rewards

NAN = float("nan")


def test_token_rewards_score_on_last_token_minus_kl():
    scores = torch.tensor([1.0, 0.5, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, NAN], [0.1, -0.1, 0.3], [NAN, NAN, NAN]])
    # kl_coef 0.5. Row 0: last masked token t=1: [-0.5*0.1, 1 - 0.5*0.2, 0] = [-0.05, 0.9, 0]
    # Row 1: last t=2: [-0.05, +0.05, 0.5 - 0.15] = [-0.05, 0.05, 0.35]
    # Row 2: empty, no token to carry its score: zeros (the NaN kl is never read)
    expected = torch.tensor([[-0.05, 0.9, 0.0], [-0.05, 0.05, 0.35], [0.0, 0.0, 0.0]])
    assert_close(token_rewards(scores, mask, kl, kl_coef=0.5), expected)


def test_token_rewards_without_kl_and_with_holes_and_int_scores():
    # The score goes on the last masked token even after a hole; kl is not read when kl_coef == 0.
    mask = torch.tensor([[1, 0, 1, 0]])
    rewards = token_rewards(torch.tensor([1]), mask, kl=torch.full((1, 4), NAN))
    assert_close(rewards, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))


def test_token_rewards_feed_gae():
    # One row, gamma = lam = 1, zero values: every advantage before whitening is the score, 3.
    rewards = token_rewards(torch.tensor([3.0]), torch.ones(1, 3))
    _, returns = gae(rewards, torch.zeros(1, 3), torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert_close(returns, torch.full((1, 3), 3.0))


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    # max_len 10, buffer 4: free up to 10 - 4 = 6 tokens, then -(L - 6)/4 down to -1 at 10, -1 beyond:
    # 5 -> 0, 6 -> 0, 7 -> -0.25, 8 -> -0.5, 10 -> -1, 12 -> -1
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert_close(overlong_penalty(lengths, max_len=10, buffer_len=4), expected)
    assert_close(overlong_penalty(lengths, max_len=10, buffer_len=4, penalty_factor=0.5), expected * 0.5)


def test_overlong_penalty_without_buffer_is_a_step():
    # buffer 0: 0 up to max_len, -penalty_factor beyond
    assert_close(overlong_penalty(torch.tensor([10, 11]), 10, 0, 2.0), torch.tensor([0.0, -2.0]))


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5)
