"""Entropy from logits (stability) and the DPO family by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import DPO_LOSSES, dpo_loss, entropy_from_logits

# ------------------------------------------------------------------------------------------ entropy


def test_entropy_by_hand():
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)], [0.0, 0.0]])
    logits = torch.stack([logits, logits + 5.0])  # [2, 3, 2]: a shift does not change the entropy
    # uniform over 2: ln 2; p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(logits), torch.tensor([[math.log(2), h, math.log(2)]] * 2))


def test_entropy_is_stable_for_huge_logits():
    logits = torch.tensor(
        [
            [1e4, 1e4, -1e4],  # two tied huge logits: ln 2
            [1e30, 0.0, 0.0],  # one-hot: 0 (exp(1e30) would overflow without logsumexp)
            [-1e30, 0.0, 0.0],  # one logit at "-infinity": ln 2
            [1e4, 1e4 - 1.0, -1e4],  # p = [1, e^-1]/(1 + e^-1) despite the huge offset
        ],
        requires_grad=True,
    )
    entropy = entropy_from_logits(logits)
    p = 1 / (1 + math.exp(-1))
    expected = torch.tensor([math.log(2), 0.0, math.log(2), -(p * math.log(p) + (1 - p) * math.log(1 - p))])
    assert_close(entropy, expected)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ------------------------------------------------------------------------------------------ DPO

# Row 0: chosen log-ratio -1 - (-1.5) = 0.5, rejected -2 - (-1.5) = -0.5 -> z = 0.1 * (0.5 + 0.5) = 0.1
# Row 1: chosen -3 - (-2) = -1, rejected -1 - (-2) = 1              -> z = 0.1 * (-1 - 1) = -0.2
CHOSEN = torch.tensor([-1.0, -3.0])
REJECTED = torch.tensor([-2.0, -1.0])
REF_CHOSEN = torch.tensor([-1.5, -2.0])
REF_REJECTED = torch.tensor([-1.5, -2.0])
BETA = 0.1


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


@pytest.mark.parametrize(
    ("kind", "label_smoothing", "expected"),
    [
        # -logsigmoid(z) = softplus(-z): softplus(-0.1) = 0.6444, softplus(0.2) = 0.7981
        ("sigmoid", 0.0, [_softplus(-0.1), _softplus(0.2)]),
        # 0.8 softplus(-z) + 0.2 softplus(z); softplus(z) = softplus(-z) + z, so = softplus(-z) + 0.2 z
        ("sigmoid", 0.2, [_softplus(-0.1) + 0.02, _softplus(0.2) - 0.04]),
        # (z/beta - 1/(2 beta))^2 with 1/(2*0.1) = 5: (1 - 5)^2 = 16, (-2 - 5)^2 = 49; smoothing ignored
        ("ipo", 0.0, [16.0, 49.0]),
        ("ipo", 0.2, [16.0, 49.0]),
        # relu(1 - z): 0.9, 1.2
        ("hinge", 0.0, [0.9, 1.2]),
    ],
)
def test_dpo_losses_by_hand(kind, label_smoothing, expected):
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, kind=kind, label_smoothing=label_smoothing
    )
    assert_close(losses, torch.tensor(expected))
    # rewards: beta * log-ratio per side
    assert_close(chosen_rewards, torch.tensor([0.05, -0.1]))
    assert_close(rejected_rewards, torch.tensor([-0.05, 0.1]))


@pytest.mark.parametrize("kind", sorted(DPO_LOSSES))
def test_dpo_gradient_flows_to_policy_and_rewards_are_detached(kind):
    chosen = CHOSEN.clone().requires_grad_()
    rejected = REJECTED.clone().requires_grad_()
    losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, REF_CHOSEN, REF_REJECTED, BETA, kind=kind)
    losses.sum().backward()
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad
    # Every kind pushes the chosen log-prob up and the rejected down (here all pairs are below margin).
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()


def test_dpo_sigmoid_gradient_by_hand():
    # d/dchosen softplus(-z) = -sigmoid(-z) * beta: row 0: -sigmoid(-0.1) * 0.1
    chosen = CHOSEN.clone().requires_grad_()
    losses, _, _ = dpo_loss(chosen, REJECTED, REF_CHOSEN, REF_REJECTED, BETA)
    losses.sum().backward()
    assert_close(chosen.grad, -BETA * torch.sigmoid(-torch.tensor([0.1, -0.2])))


def test_dpo_sigmoid_is_finite_for_extreme_margins():
    losses, _, _ = dpo_loss(torch.tensor([1e4, -1e4]), torch.zeros(2), torch.zeros(2), torch.zeros(2), beta=1.0)
    # z = +-1e4: softplus(-1e4) = 0 and softplus(1e4) = 1e4, no overflow in exp
    assert_close(losses, torch.tensor([0.0, 1e4]))


def test_dpo_unknown_kind():
    with pytest.raises(ValueError, match="unknown DPO loss kind 'kto'.*'hinge'.*'ipo'.*'sigmoid'"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, kind="kto")
