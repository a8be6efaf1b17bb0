"""GSPO and CISPO policy losses, hand-worked: values, gradients (GSPO's stop-gradient form, CISPO's detached
weight), stats, masking and the edge cases of the contract (empty row, one-token row, the clamp at 10)."""

import math

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import POLICY_LOSSES, cispo_loss, get_policy_loss, gspo_loss, policy_loss

NAN = float("nan")
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

# ---------------------------------------------------------------------------------------------------- GSPO
# old_logp = 0, so logp is the per-token log-ratio. Clip 0.2 -> [0.8, 1.2]. Four rows:
#   row  log-ratios        A    log_s = row mean   s = e^log_s    -A*s      -A*clip(s)  l (each token)  clipped?
#   0    0.3 -0.1 0.1     +1    0.1                1.10517        -1.10517  -1.10517    -1.10517        no
#   1    0.5  0.3 (NaN)   -1    0.4                1.49182        +1.49182  +1.2        +1.49182        no
#   2    0.5  0.3 (NaN)   +1    0.4                1.49182        -1.49182  -1.2        -1.2            yes
#   3    (empty row)       -    s = 1, adds nothing
# seq-mean-token-mean = (-1.10517 + 1.49182 - 1.2) / 3 nonempty rows.
# Gradient: r_t's gradient is r_t with respect to its own logp_t only, so d l_t / d logp_t = -A_t * s on an
# unclipped token, 0 on a clipped one; then / n_i (the row's token mean) / 3 (the rows).
#   row 0: -e^0.1 / 3 / 3 each; row 1: +e^0.4 / 2 / 3 each; row 2: 0.
G_LOGP = torch.tensor([[0.3, -0.1, 0.1], [0.5, 0.3, NAN], [0.5, 0.3, NAN], [NAN, NAN, NAN]])
G_ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, NAN], [1.0, 1.0, NAN], [NAN, NAN, NAN]])
G_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [0, 0, 0]])
E1, E4 = math.exp(0.1), math.exp(0.4)


def _gspo(agg="seq-mean-token-mean", **kw):
    logp = G_LOGP.clone().requires_grad_()
    old = torch.where(G_MASK.bool(), 0.0, NAN).requires_grad_()  # NaN where masked: must not be read
    loss, stats = gspo_loss(logp, old, G_ADV, G_MASK, kw.pop("clip_low", 0.2), kw.pop("clip_high", 0.2), agg)
    loss.backward()
    return loss, stats, logp.grad, old.grad


def test_gspo_by_hand():
    loss, stats, grad, old_grad = _gspo()
    assert_close(loss, torch.tensor((-E1 + E4 - 1.2) / 3))
    want = torch.tensor([[-E1 / 9, -E1 / 9, -E1 / 9], [E4 / 6, E4 / 6, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(grad, want)
    assert old_grad is None or (old_grad == 0).all()  # no gradient through old_logp
    assert stats["clip_frac"] == pytest.approx(2 / 7)  # row 2's two tokens of the 7 masked
    # approx_kl: masked mean of old - logp, per token, unclamped = -(0.3 - 0.1 + 0.1 + 0.5 + 0.3 + 0.5 + 0.3) / 7
    assert stats["approx_kl"] == pytest.approx(-1.9 / 7)
    assert set(stats) >= {"clip_frac", "approx_kl"} and all(isinstance(v, float) for v in stats.values())


def test_gspo_every_aggregation_mode():
    # Per-token losses: row 0: 3 x -e^0.1; row 1: 2 x e^0.4; row 2: 2 x -1.2 (7 tokens, 3 rows, width 3).
    total = -3 * E1 + 2 * E4 - 2.4
    want = {"token-mean": total / 7, "seq-mean-token-mean": (-E1 + E4 - 1.2) / 3,
            "seq-mean-token-sum": total / 3, "seq-mean-token-sum-norm": total / 3}
    for agg in AGGS:
        loss, _, grad, _ = _gspo(agg)
        assert_close(loss, torch.tensor(want[agg]), msg=agg)
        assert torch.isfinite(grad).all() and (grad[G_MASK == 0] == 0).all(), agg
    # token-mean: d/dlogp_t = -A_t * s / 7 on unclipped tokens
    assert_close(_gspo("token-mean")[2][0], torch.full((3,), -E1 / 7))


def test_gspo_gradient_goes_to_each_token_alone():
    # One row, log-ratios [0.2, 0.0] (s = e^0.1), advantages [1, 2]: token t's gradient is -A_t * s / 2
    # (token-mean), from its own ratio only. Through s (the sequence form) it would be -(A_0 + A_1) * s / 4 each.
    logp = torch.tensor([[0.2, 0.0]], requires_grad=True)
    loss, _ = gspo_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 2.0]]), torch.ones(1, 2), 0.2, 0.2,
                        "token-mean")
    loss.backward()
    assert_close(loss, torch.tensor(-(1 + 2) * E1 / 2))
    assert_close(logp.grad, torch.tensor([[-E1 / 2, -2 * E1 / 2]]))


def test_gspo_with_constant_advantages_is_sequence_level_gspo():
    # The sequence-level objective written directly: s_i = exp(mean_t(logp - old)), l_i = max(-A s, -A clip(s)).
    g = torch.Generator().manual_seed(0)
    logp0 = torch.randn(5, 6, generator=g) * 0.3
    old = torch.randn(5, 6, generator=g) * 0.3
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5, [1] * 3 + [0] * 3, [1] * 5 + [0]])
    a = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5])
    for low, high in ((0.2, 0.2), (3e-4, 4e-4)):
        logp_t, logp_s = logp0.clone().requires_grad_(), logp0.clone().requires_grad_()
        loss_t, _ = gspo_loss(logp_t, old, a[:, None] * mask, mask, low, high)
        n = mask.sum(-1)
        s = torch.exp(((logp_s - old) * mask).sum(-1) / n)
        loss_s = torch.maximum(-a * s, -a * s.clamp(1 - low, 1 + high)).mean()
        loss_t.backward()
        loss_s.backward()
        assert_close(loss_t, loss_s)
        assert_close(logp_t.grad, logp_s.grad * mask)


def test_gspo_empty_row_and_one_token_row():
    # Row 0 has one token, log-ratio 0.1: s = e^0.1, clipped at 1 + 4e-4 by the defaults (A = +1: -1.0004 wins).
    # Row 1 is empty: s = 1, it adds nothing (seq-mean over the one non-empty row).
    logp = torch.tensor([[0.1, NAN], [NAN, NAN]], requires_grad=True)
    loss, stats = gspo_loss(logp, torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([[1, 0], [0, 0]]))
    loss.backward()
    assert_close(loss, torch.tensor(-1.0004))
    assert stats["clip_frac"] == 1.0 and (logp.grad == 0).all()
    # Inside the default range: log-ratios [2e-4, 0] -> s = e^1e-4 = 1.0001 in [0.9997, 1.0004]: not clipped.
    logp = torch.tensor([[2e-4, 0.0]], requires_grad=True)
    loss, stats = gspo_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss.backward()
    assert_close(loss, torch.tensor(-math.exp(1e-4)))
    assert stats["clip_frac"] == 0.0
    assert_close(logp.grad, torch.full((1, 2), -math.exp(1e-4) / 2))
    # All masked: 0, finite.
    nan = torch.full((2, 2), NAN)
    loss, stats = gspo_loss(nan.clone().requires_grad_(), nan, nan, torch.zeros(2, 2))
    assert loss.item() == 0.0 and stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0


def test_gspo_sequence_ratio_clamped_at_e10_without_per_token_clamp():
    # log-ratios [12, 10, 14]: log_s = 12 > 10 -> r = e^10 on every token, and no gradient (the clamp).
    logp = torch.tensor([[12.0, 10.0, 14.0]], requires_grad=True)
    loss, stats = gspo_loss(logp, torch.zeros(1, 3), -torch.ones(1, 3), torch.ones(1, 3), 0.2, 0.2)
    loss.backward()
    assert_close(loss, torch.tensor(math.exp(10)))  # A = -1: -A*r = e^10 beats -A*1.2
    assert (logp.grad == 0).all() and stats["clip_frac"] == 0.0
    # log-ratios [30, -20]: unclamped mean 5 -> s = e^5 (clamping each token to [-20, 20] first would give 0).
    loss, stats = gspo_loss(torch.tensor([[30.0, -20.0]]), torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2),
                            0.2, 0.2)
    assert_close(loss, torch.tensor(math.exp(5)))
    assert stats["approx_kl"] == pytest.approx(-5.0)


# --------------------------------------------------------------------------------------------------- CISPO
# old_logp = 0, ratio = exp(logp). Four tokens, clip_high 0.2, no lower bound (clip_low=None):
#   ratio  A    w = min(r, 1.2)   l = -w*A*logp        d l / d logp = -w*A    outside the bounds?
#   1.5   +1    1.2               -1.2*ln1.5           -1.2                   yes (PPO would give 0 here)
#   0.5   +1    0.5               -0.5*ln0.5           -0.5                   no (no lower bound)
#   1.0   -1    1.0               0                    +1.0                   no
#   3.0   -1    1.2               +1.2*ln3             +1.2                   yes
C_RATIOS = torch.tensor([[1.5, 0.5], [1.0, 3.0]])
C_ADV = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])


def _cispo(**kw):
    logp = C_RATIOS.log().clone().requires_grad_()
    old = torch.zeros(2, 2, requires_grad=True)
    loss, stats = cispo_loss(logp, old, C_ADV, torch.ones(2, 2), **kw)
    loss.backward()
    return loss, stats, logp.grad, old.grad


def test_cispo_by_hand_without_lower_bound():
    loss, stats, grad, old_grad = _cispo()
    want = (-1.2 * math.log(1.5) - 0.5 * math.log(0.5) + 0.0 + 1.2 * math.log(3.0)) / 4
    assert_close(loss, torch.tensor(want))
    assert_close(grad, torch.tensor([[-1.2, -0.5], [1.0, 1.2]]) / 4)  # clipped tokens keep a gradient
    assert old_grad is None or (old_grad == 0).all()  # the weight is detached
    assert stats["clip_frac"] == pytest.approx(2 / 4)
    assert stats["approx_kl"] == pytest.approx(-math.log(1.5 * 0.5 * 1.0 * 3.0) / 4)
    # PPO on the same tokens: the clipped token (ratio 1.5, A = +1) has no gradient at all.
    logp = C_RATIOS.log().clone().requires_grad_()
    policy_loss(logp, torch.zeros(2, 2), C_ADV, torch.ones(2, 2))[0].backward()
    assert logp.grad[0, 0] == 0 and grad[0, 0] != 0


def test_cispo_with_a_lower_bound():
    # clip_low 0.2: the ratio 0.5 token gets w = 0.8 and counts as outside the bounds.
    loss, stats, grad, _ = _cispo(clip_low=0.2)
    assert_close(grad, torch.tensor([[-1.2, -0.8], [1.0, 1.2]]) / 4)
    assert_close(loss, torch.tensor((-1.2 * math.log(1.5) - 0.8 * math.log(0.5) + 1.2 * math.log(3.0)) / 4))
    assert stats["clip_frac"] == pytest.approx(3 / 4)
    # ScaleRL's absolute cap 5.0 is clip_high = 4.0: ratio 3 is then inside, w = 3.
    _, stats, grad, _ = _cispo(clip_high=4.0)
    assert_close(grad, torch.tensor([[-1.5, -0.5], [1.0, 3.0]]) / 4)
    assert stats["clip_frac"] == 0.0


def test_cispo_ratio_clamped_at_20_and_masked_positions_not_read():
    # log-ratio 50 on one token: ratio e^20 (not e^50), w = 1.2; it lies outside the bounds.
    logp = torch.tensor([[50.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, NAN]])
    loss, stats = cispo_loss(logp, old, torch.tensor([[2.0, NAN]]), torch.tensor([[1, 0]]), agg="seq-mean-token-sum")
    loss.backward()
    assert_close(loss, torch.tensor(-1.2 * 2.0 * 50.0))
    assert_close(logp.grad, torch.tensor([[-1.2 * 2.0, 0.0]]))
    assert stats["clip_frac"] == 1.0
    for agg in AGGS:
        nan = torch.full((2, 2), NAN)
        loss, stats = cispo_loss(nan.clone().requires_grad_(), nan, nan, torch.zeros(2, 2), agg=agg)
        assert loss.item() == 0.0 and stats["clip_frac"] == 0.0


def test_config_errors():
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        gspo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), agg="sum")
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        cispo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), agg="sum")


def test_policy_losses_by_name():
    assert POLICY_LOSSES == {"ppo": policy_loss, "gspo": gspo_loss, "cispo": cispo_loss}
    assert get_policy_loss("gspo") is gspo_loss
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'; known: 'cispo', 'gspo', 'ppo'"):
        get_policy_loss("grpo")
