"""Clipped value loss by hand, clip_frac, masking and gradients."""

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import value_loss

NAN = float("nan")

# clip = 0.5, so v is clipped into [old - 0.5, old + 0.5]:
#   v    old  R     (v-R)^2   clip(v)  (clip(v)-R)^2   0.5*max   clipped term larger?
#   1.0  0.8  1.5   0.25      1.0      0.25            0.125     no  (v inside [0.3, 1.3])
#   2.0  1.0  3.0   1.0       1.5      2.25            1.125     yes
#   2.0  1.0  1.0   1.0       1.5      0.25            0.5       no
#   0.0  1.0  0.0   0.0       0.5      0.25            0.125     yes
#   masked (NaN) x 2
VALUES = torch.tensor([[1.0, 2.0, 2.0], [0.0, NAN, NAN]])
OLD_VALUES = torch.tensor([[0.8, 1.0, 1.0], [1.0, NAN, NAN]])
RETURNS = torch.tensor([[1.5, 3.0, 1.0], [0.0, NAN, NAN]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_value_loss_by_hand():
    values = VALUES.clone().requires_grad_()
    loss, stats = value_loss(values, OLD_VALUES, RETURNS, MASK)
    # token-mean: (0.125 + 1.125 + 0.5 + 0.125) / 4 = 1.875 / 4 = 0.46875
    assert_close(loss, torch.tensor(0.46875))
    assert stats == {"clip_frac": pytest.approx(0.5)}
    assert isinstance(stats["clip_frac"], float)
    # Gradient / 4 tokens. Unclipped term wins: d/dv 0.5 (v-R)^2 = v - R. Clipped term wins and v is
    # outside the clip range: 0 (clip(v) is a constant). Tokens: [1-1.5, 0, 2-1, 0] / 4; masked: 0.
    loss.backward()
    assert_close(values.grad, torch.tensor([[-0.5, 0.0, 1.0], [0.0, 0.0, 0.0]]) / 4)


def test_value_loss_seq_mean_token_sum():
    # row sums [0.125 + 1.125 + 0.5, 0.125] = [1.75, 0.125] -> mean 0.9375
    loss, _ = value_loss(VALUES, OLD_VALUES, RETURNS, MASK, agg="seq-mean-token-sum")
    assert_close(loss, torch.tensor(0.9375))


def test_value_loss_all_masked_is_finite():
    nan = torch.full((1, 2), NAN)
    loss, stats = value_loss(nan, nan, nan, torch.zeros(1, 2))
    assert loss.item() == 0.0 and stats["clip_frac"] == 0.0
