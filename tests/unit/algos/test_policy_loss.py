"""PPO clipped surrogate: clip, asymmetric clip, dual clip, stats, masking and gradients."""

import math

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import policy_loss

NAN = float("nan")

# old_logp = 0, so ratio = exp(logp) and logp = log(ratio). Six tokens, clip 0.2 -> [0.8, 1.2]:
#   ratio  A    -A*r   -A*clip(r)   l = max           clipped term larger?
#   1.0   +1    -1.0   -1.0         -1.0              no
#   1.5   +1    -1.5   -1.2         -1.2              yes
#   0.5   +1    -0.5   -0.8         -0.5              no
#   1.5   -1    +1.5   +1.2         +1.5              no
#   0.5   -1    +0.5   +0.8         +0.8              yes
#   3.0   -1    +3.0   +1.2         +3.0 (dual c=2: min(3, 2) = 2)  no
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.5, 0.5, 3.0]])
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
MASK = torch.ones(2, 3)


def _logp():
    return RATIOS.log().clone().requires_grad_()


def test_policy_loss_clipping_by_hand():
    logp = _logp()
    loss, stats = policy_loss(logp, torch.zeros(2, 3), ADVANTAGES, MASK)
    # token-mean: (-1 - 1.2 - 0.5 + 1.5 + 0.8 + 3) / 6 = 2.6 / 6
    assert_close(loss, torch.tensor(2.6 / 6))
    assert stats["clip_frac"] == pytest.approx(2 / 6)
    # approx_kl = mean(old - logp) = -(ln1 + ln1.5 + ln0.5 + ln1.5 + ln0.5 + ln3)/6 = -ln(1.6875)/6
    assert stats["approx_kl"] == pytest.approx(-math.log(1.6875) / 6, abs=1e-6)
    assert stats["dual_clip_frac"] == 0.0
    assert all(isinstance(v, float) for v in stats.values())
    # Gradient: d(-A*r)/dlogp = -A*r on unclipped tokens, 0 on clipped ones; token-mean divides by 6.
    loss.backward()
    assert_close(logp.grad, torch.tensor([[-1.0, 0.0, -0.5], [1.5, 0.0, 3.0]]) / 6)


def test_policy_loss_dual_clip_by_hand():
    logp = _logp()
    loss, stats = policy_loss(logp, torch.zeros(2, 3), ADVANTAGES, MASK, dual_clip=2.0)
    # The last token (A<0, l=3) is bounded at -A*c = 2: (-2.7 + 1.5 + 0.8 + 2) / 6 = 1.6 / 6
    assert_close(loss, torch.tensor(1.6 / 6))
    assert stats["dual_clip_frac"] == pytest.approx(1 / 6)
    loss.backward()
    assert logp.grad[1, 2] == 0  # a constant bound has no gradient


def test_policy_loss_asymmetric_clip_higher():
    # ratio 1.25 with A=+1: clip_high 0.28 -> 1.25 is inside [0.8, 1.28], l = -1.25 (not clipped);
    # ratio 0.75 with A=-1: clip_low 0.2 -> clip(0.75) = 0.8, l = max(0.75, 0.8) = 0.8 (clipped).
    # mean of [-1.25, 0.8] = -0.225
    logp = torch.tensor([[1.25, 0.75]]).log()
    loss, stats = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.28)
    assert_close(loss, torch.tensor(-0.225))
    assert stats["clip_frac"] == pytest.approx(0.5)
    # Symmetric 0.2 clips the first token too: mean of [-1.2, 0.8] = -0.2
    loss, stats = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    assert_close(loss, torch.tensor(-0.2))
    assert stats["clip_frac"] == pytest.approx(1.0)


def test_policy_loss_ratio_log_is_clamped_at_20():
    # logp - old = 50 -> ratio exp(20), not exp(50); A = -1, unclipped term e^20 is the larger one.
    loss, _ = policy_loss(torch.tensor([[50.0]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1))
    assert_close(loss, torch.tensor(math.exp(20)))


def test_policy_loss_masked_positions_are_not_read():
    logp = torch.tensor([[RATIOS[0, 0].log(), NAN], [NAN, NAN]], requires_grad=True)
    old_logp = torch.tensor([[0.0, NAN], [NAN, NAN]])
    advantages = torch.tensor([[2.0, NAN], [NAN, NAN]])
    mask = torch.tensor([[1, 0], [0, 0]])
    for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        logp.grad = None
        loss, stats = policy_loss(logp, old_logp, advantages, mask, agg=agg)
        loss.backward()
        assert torch.isfinite(loss) and all(math.isfinite(v) for v in stats.values())
        assert torch.isfinite(logp.grad).all() and (logp.grad[mask == 0] == 0).all()
    # token-mean of the one token: -A * r = -2 * 1 = -2
    assert_close(policy_loss(logp, old_logp, advantages, mask)[0], torch.tensor(-2.0))


def test_policy_loss_all_masked_is_zero():
    nan = torch.full((2, 2), NAN)
    loss, stats = policy_loss(nan.clone().requires_grad_(), nan, nan, torch.zeros(2, 2))
    assert loss.item() == 0.0 and stats == {"clip_frac": 0.0, "approx_kl": 0.0, "dual_clip_frac": 0.0}


def test_policy_loss_config_errors():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(_logp(), torch.zeros(2, 3), ADVANTAGES, MASK, dual_clip=0.9)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        policy_loss(_logp(), torch.zeros(2, 3), ADVANTAGES, MASK, agg="sum")
