"""Advantage estimators, hand-worked (gamma = lam = 0.5 keeps the arithmetic exact in binary)."""

import math

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import ADVANTAGES, gae, get_advantage, grpo, opd_advantages, reinforce_pp, rloo

NAN = float("nan")


def _whiten(raw: list[float]) -> torch.Tensor:
    """Reference whitening of a flat list: masked mean, unbiased variance, eps inside the sqrt."""
    mean = sum(raw) / len(raw)
    var = sum((x - mean) ** 2 for x in raw) / (len(raw) - 1)
    return torch.tensor([(x - mean) / math.sqrt(var + 1e-8) for x in raw])


# ------------------------------------------------------------------------------------------ GAE


def test_gae_2x3_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, NAN]])
    values = torch.tensor([[0.5, 1.0, 0.5], [1.0, 0.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma = lam = 0.5, so gamma * lam = 0.25. Row 0, from the end (V_3 = A_3 = 0):
    #   t=2: delta = 1 + 0.5*0 - 0.5 = 0.5          A = 0.5
    #   t=1: delta = 0 + 0.5*0.5 - 1.0 = -0.75      A = -0.75 + 0.25*0.5 = -0.625
    #   t=0: delta = 0 + 0.5*1.0 - 0.5 = 0          A = 0 + 0.25*(-0.625) = -0.15625
    # Row 1 ends at t=1 (the NaN slot is never read):
    #   t=1: delta = 2 + 0 - 0 = 2                  A = 2
    #   t=0: delta = 0 + 0.5*0 - 1 = -1             A = -1 + 0.25*2 = -0.5
    # returns = A + V: row 0 [0.34375, 0.375, 1.0], row 1 [0.5, 2.0, 0 (masked)]
    advantages, returns = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert_close(returns, torch.tensor([[0.34375, 0.375, 1.0], [0.5, 2.0, 0.0]]))
    # Whitened over the 5 masked A's: mean = 1.21875/5 = 0.24375, squared deviations sum to 4.61796875,
    # unbiased var = 4.61796875/4 = 1.1544921875.
    white = _whiten([-0.15625, -0.625, 0.5, -0.5, 2.0])
    expected = torch.tensor([[white[0], white[1], white[2]], [white[3], white[4], 0.0]])
    assert_close(advantages, expected)


def test_gae_lam_one_gamma_one_is_return_minus_value():
    # With gamma = lam = 1, A_t = sum_{s>=t} r_s - V_t: rewards [0, 0, 1] -> returns-to-go [1, 1, 1].
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.6]])
    _, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert_close(returns, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_skips_holes_in_the_mask():
    # A hole (mask 0 at t=1) is transparent: t=0 bootstraps from V_2 and A_2.
    # gamma = lam = 1: t=2: A = 1 - 0.5 = 0.5; t=0: delta = 0 + V_2 - V_0 = 0.5 - 0 = 0.5, A = 0.5 + 0.5 = 1
    # returns = [1 + 0, 0, 0.5 + 0.5] = [1, 0, 1]
    _, returns = gae(
        torch.tensor([[0.0, NAN, 1.0]]), torch.tensor([[0.0, NAN, 0.5]]), torch.tensor([[1, 0, 1]]), 1.0, 1.0
    )
    assert_close(returns, torch.tensor([[1.0, 0.0, 1.0]]))


def test_gae_degenerate_rows_are_finite():
    rewards = torch.tensor([[NAN, NAN], [3.0, NAN]])
    values = torch.tensor([[NAN, NAN], [1.0, NAN]])
    mask = torch.tensor([[0, 0], [1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.95)
    # One masked token in the batch: whitening gives 0; its return is r + gamma*0 - V + V = 3.
    assert_close(advantages, torch.zeros(2, 2))
    assert_close(returns, torch.tensor([[0.0, 0.0], [3.0, 0.0]]))


def test_gae_does_not_track_gradients():
    values = torch.tensor([[0.5, 0.5]], requires_grad=True)
    advantages, returns = gae(torch.ones(1, 2), values, torch.ones(1, 2), 1.0, 1.0)
    assert not advantages.requires_grad and not returns.requires_grad


# ------------------------------------------------------------------------------------------ GRPO

# Interleaved groups: group 0 = samples {0, 2} with scores [1, 0]; group 1 = {1, 3, 5} with [2, 4, 6];
# group 2 = {4} with [3] (one sample).
SCORES = torch.tensor([1.0, 2.0, 0.0, 4.0, 3.0, 6.0])
IDS = ["q0", "q1", "q0", "q1", "q2", "q1"]


@pytest.mark.parametrize("group_ids", [IDS, torch.tensor([7, 3, 7, 3, 9, 3])], ids=["list", "tensor"])
def test_grpo_by_hand(group_ids):
    mask = torch.tensor([[1, 1, 1]] * 5 + [[1, 0, 0]])
    # group 0: mean 0.5, unbiased var (0.25 + 0.25)/1 = 0.5, std sqrt(0.5); a = +-0.5 / (sqrt(0.5) + 1e-6)
    # group 1: mean 4, unbiased var (4 + 0 + 4)/2 = 4, std 2; a = [-2, 0, 2] / (2 + 1e-6)
    # group 2: one sample -> mean 0, std 1; a = 3 / (1 + 1e-6)
    s0 = math.sqrt(0.5) + 1e-6
    per_seq = torch.tensor([0.5 / s0, -2 / 2.000001, -0.5 / s0, 0.0, 3 / 1.000001, 2 / 2.000001])
    assert_close(grpo(SCORES, group_ids, mask), per_seq[:, None] * mask)


def test_grpo_without_std_normalisation():
    # a = s - mean_g: [1-0.5, 2-4, 0-0.5, 4-4, 3-0 (one sample: mean 0), 6-4]
    expected = torch.tensor([0.5, -2.0, -0.5, 0.0, 3.0, 2.0])
    assert_close(grpo(SCORES, IDS, torch.ones(6, 2), norm_by_std=False), expected[:, None].expand(6, 2))


def test_grpo_eps_is_added_to_the_std():
    scores = torch.tensor([0.0, 2e-6], dtype=torch.float64)
    # mean 1e-6, unbiased std sqrt((1e-12 + 1e-12)/1) = sqrt(2)*1e-6;
    # a = +-1e-6 / (sqrt(2)*1e-6 + 1e-6) = +-1/(sqrt(2) + 1) = +-(sqrt(2) - 1) = +-0.41421
    expected = torch.tensor([[-1.0], [1.0]], dtype=torch.float64) * (math.sqrt(2) - 1)
    assert_close(grpo(scores, [0, 0], torch.ones(2, 1)), expected)


def test_grpo_all_equal_scores_give_zero_and_int_scores_work():
    # std 0: (1 - 1) / (0 + 1e-6) = 0, no NaN.
    assert_close(grpo(torch.tensor([1, 1, 1]), [0, 0, 0], torch.ones(3, 2)), torch.zeros(3, 2))


# ------------------------------------------------------------------------------------------ RLOO


def test_rloo_by_the_formula():
    # a_i = s_i * n/(n-1) - mean_g * n/(n-1)
    # group 0 (n=2, mean 0.5): [1*2 - 0.5*2, 0*2 - 0.5*2] = [1, -1]
    # group 1 (n=3, mean 4):   1.5 * ([2, 4, 6] - 4) = [-3, 0, 3]   (= s_i - mean of the others: 2 - 5 = -3)
    # group 2 (n=1):           a = s = 3
    expected = torch.tensor([1.0, -3.0, -1.0, 0.0, 3.0, 3.0])
    mask = torch.tensor([[1, 1]] * 5 + [[0, 0]])
    assert_close(rloo(SCORES, IDS, mask), expected[:, None] * mask)
    assert_close(rloo(SCORES, torch.tensor([0, 1, 0, 1, 2, 1]), mask), expected[:, None] * mask)


# ---------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_returns_then_whitening():
    rewards = torch.tensor([[0.0, -0.1, 1.0], [2.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # gamma = 0.5. Row 0: R_2 = 1; R_1 = -0.1 + 0.5*1 = 0.4; R_0 = 0 + 0.5*0.4 = 0.2. Row 1: R_0 = 2.
    advantages, returns = reinforce_pp(rewards, mask, gamma=0.5)
    assert_close(returns, torch.tensor([[0.2, 0.4, 1.0], [2.0, 0.0, 0.0]]))
    # masked returns [0.2, 0.4, 1, 2]: mean 0.9, squared deviations 0.49+0.25+0.01+1.21 = 1.96, var 1.96/3
    white = _whiten([0.2, 0.4, 1.0, 2.0])
    assert_close(advantages, torch.tensor([[white[0], white[1], white[2]], [white[3], 0.0, 0.0]]))


def test_reinforce_pp_all_masked_is_finite():
    advantages, returns = reinforce_pp(torch.full((2, 3), NAN), torch.zeros(2, 3), gamma=1.0)
    assert_close(advantages, torch.zeros(2, 3))
    assert_close(returns, torch.zeros(2, 3))


# ------------------------------------------------------------------------------------------ registry


def test_registry_maps_names_to_functions():
    assert ADVANTAGES == {"gae": gae, "grpo": grpo, "rloo": rloo, "reinforce_pp": reinforce_pp}
    assert get_advantage("rloo") is rloo


def test_unknown_estimator_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*'gae'.*'grpo'.*'reinforce_pp'.*'rloo'"):
        get_advantage("ppo")


# ------------------------------------------------------------------------------------ on-policy distillation


def test_opd_advantages_by_hand():
    # A_hat = (A - coef * (student - teacher)) * mask, no clamp, no whitening:
    #   token 0: 0.5 - (-1 + 1.5) = 0;  token 1: 0.5 - (-2 + 2) = 0.5;  token 2: 0.5 - (-3 + 60) = -56.5
    #   token 3: masked (NaN everywhere) -> 0
    adv = torch.tensor([[0.5, 0.5, 0.5, NAN]], requires_grad=True)
    student = torch.tensor([[-1.0, -2.0, -3.0, NAN]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -2.0, -60.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = opd_advantages(adv, student, teacher, mask)
    assert_close(out, torch.tensor([[0.0, 0.5, -56.5, 0.0]]))
    assert not out.requires_grad  # a target, never differentiated
    # coef 0.5: 0.5 - 0.25 = 0.25; 0.5; 0.5 - 28.5 = -28
    assert_close(opd_advantages(adv, student, teacher, mask, coef=0.5), torch.tensor([[0.25, 0.5, -28.0, 0.0]]))
    # Pure distillation (no estimator): A = 0
    assert_close(opd_advantages(None, student, teacher, mask), torch.tensor([[-0.5, 0.0, -57.0, 0.0]]))
    # Composes with an estimator's output: GRPO advantages of a 2-sample group, scores 1 and 0 -> +-1/(std+eps)
    g = grpo(torch.tensor([1.0, 0.0]), [0, 0], torch.ones(2, 1))
    out = opd_advantages(g, torch.tensor([[-1.0], [-1.0]]), torch.tensor([[-2.0], [-0.5]]), torch.ones(2, 1))
    assert_close(out, g - torch.tensor([[1.0], [-0.5]]))


def test_opd_is_not_an_estimator():
    assert "opd" not in ADVANTAGES and opd_advantages not in ADVANTAGES.values()
