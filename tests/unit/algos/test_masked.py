"""Masked reductions: hand-worked values, empty masks, NaN under the mask."""

import math

import torch
from torch.testing import assert_close

from hybrid_rl.algos import explained_variance, masked_mean, masked_sum, masked_var, masked_whiten

NAN = float("nan")


def test_masked_sum_and_mean_ignore_nan_under_mask():
    values = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # sum = 1 + 2 + 4 = 7; mean = 7 / 3
    assert_close(masked_sum(values, mask), torch.tensor(7.0))
    assert_close(masked_mean(values, mask), torch.tensor(7.0 / 3))
    # per row: [1+2, 4] and means [3/2, 4/1]
    assert_close(masked_sum(values, mask, dim=-1), torch.tensor([3.0, 4.0]))
    assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 4.0]))


def test_masked_mean_of_empty_mask_is_zero():
    values = torch.full((2, 3), NAN)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert_close(masked_mean(values, mask), torch.tensor(0.0))
    assert_close(masked_mean(values, mask, dim=-1), torch.zeros(2))


def test_masked_var_is_unbiased():
    values = torch.tensor([[1.0, 2.0], [3.0, NAN]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # mean 2; squared deviations 1 + 0 + 1 = 2; unbiased: 2 / (3 - 1) = 1; biased: 2 / 3
    assert_close(masked_var(values, mask), torch.tensor(1.0))
    assert_close(masked_var(values, mask, unbiased=False), torch.tensor(2.0 / 3))


def test_masked_var_of_one_or_zero_tokens_is_zero():
    values = torch.tensor([[5.0, NAN]])
    assert_close(masked_var(values, torch.tensor([[1, 0]])), torch.tensor(0.0))
    assert_close(masked_var(values, torch.tensor([[0, 0]])), torch.tensor(0.0))


def test_masked_whiten_hand_worked():
    values = torch.tensor([[1.0, 2.0], [3.0, NAN]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8); the masked slot is 0
    std = math.sqrt(1 + 1e-8)
    assert_close(masked_whiten(values, mask), torch.tensor([[-1 / std, 0.0], [1 / std, 0.0]]))


def test_masked_whiten_eps_is_inside_the_sqrt():
    values = torch.tensor([[0.0, 2e-4]], dtype=torch.float64)
    # mean 1e-4, deviations +-1e-4, unbiased var 2e-8: +-1e-4 / sqrt(2e-8 + 1e-8) = +-1/sqrt(3).
    # (eps outside, 1e-4 / (sqrt(2e-8) + 1e-8), would give +-0.7071.)
    expected = torch.tensor([[-1.0, 1.0]], dtype=torch.float64) / math.sqrt(3)
    assert_close(masked_whiten(values, torch.ones(1, 2)), expected)


def test_masked_whiten_degenerate_inputs_are_finite_zeros():
    # A single token: var defined as 0, (x - x) / sqrt(0 + 1e-8) = 0. No token at all: zeros.
    assert_close(masked_whiten(torch.tensor([[7.0, NAN]]), torch.tensor([[1, 0]])), torch.zeros(1, 2))
    assert_close(masked_whiten(torch.full((2, 2), NAN), torch.zeros(2, 2)), torch.zeros(2, 2))


def test_explained_variance_hand_worked():
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN]])
    values = torch.tensor([[1.0, 2.0, 3.0], [5.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # R = [1,2,3,4]: mean 2.5, squared deviations 2.25+0.25+0.25+2.25 = 5 -> Var[R] = 5/3
    # R - V = [0,0,0,-1]: mean -0.25, squared deviations 3*0.0625 + 0.5625 = 0.75 -> Var = 0.25
    # EV = 1 - 0.25 / (5/3) = 1 - 0.15 = 0.85
    assert_close(explained_variance(values, returns, mask), torch.tensor(0.85))


def test_explained_variance_is_zero_when_returns_are_constant():
    returns = torch.ones(2, 2)
    values = torch.tensor([[0.0, 3.0], [1.0, 1.0]])
    assert_close(explained_variance(values, returns, torch.ones(2, 2)), torch.tensor(0.0))
