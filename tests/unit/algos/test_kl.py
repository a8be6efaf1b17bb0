"""KL estimators by hand, k3's clamps, masking, and the registry."""

import math

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import KL_ESTIMATORS, aggregate, check_kl_estimator, kl

NAN = float("nan")

# d = logp - ref_logp = [0, 1, -2, -3, 11.5]
LOGP = torch.tensor([[0.0, 1.0, -2.0, -3.0, 11.5]])
REF = torch.zeros(1, 5)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [0.0, 1.0, -2.0, -3.0, 11.5]),  # d
        ("abs", [0.0, 1.0, 2.0, 3.0, 11.5]),  # |d|
        ("k2", [0.0, 0.5, 2.0, 4.5, 66.125]),  # 0.5 d^2: 0.5*4 = 2, 0.5*9 = 4.5, 0.5*132.25 = 66.125
        # exp(-d) - 1 + d: d=0 -> 0; d=1 -> e^-1 = 0.3679; d=-2 -> e^2 - 3 = 4.3891;
        # d=-3 -> e^3 - 4 = 16.09, clamped to 10; d=11.5 -> e^-11.5 + 10.5 = 10.50001, clamped to 10
        ("k3", [0.0, math.exp(-1), math.exp(2) - 3, 10.0, 10.0]),
        ("low_var_kl", [0.0, math.exp(-1), math.exp(2) - 3, 10.0, 10.0]),
    ],
)
def test_kl_estimators_by_hand(kind, expected):
    assert_close(kl(LOGP, REF, kind), torch.tensor([expected]))


def test_k3_clamps_d_to_20_so_gradients_stay_finite():
    # |d| > 20: d is clamped to +-20 first; e^20 - 21 and e^-20 + 19 are both > 10 -> 10.
    # Without the d clamp, d = -1000 gives exp(1000) = inf and the backward pass 0 * inf = NaN.
    logp = torch.tensor([[-25.0, 25.0, -1000.0, 1000.0]], requires_grad=True)
    value = kl(logp, torch.zeros(1, 4), "k3")
    value.sum().backward()
    assert_close(value, torch.full((1, 4), 10.0))
    assert_close(logp.grad, torch.zeros(1, 4))  # saturated clamps pass no gradient


def test_k3_gradient_inside_the_clamps():
    # d/dd [exp(-d) - 1 + d] = 1 - exp(-d): at d = 1, 1 - e^-1 = 0.6321; at d = 0, 0
    logp = torch.tensor([[1.0, 0.0]], requires_grad=True)
    kl(logp, torch.zeros(1, 2), "k3").sum().backward()
    assert_close(logp.grad, torch.tensor([[1 - math.exp(-1), 0.0]]))


def test_only_k3_is_clamped():
    # The spec's clamps belong to k3; k1/abs/k2 are returned as computed.
    assert kl(torch.tensor([[25.0]]), torch.zeros(1, 1), "k1").item() == 25.0
    assert kl(torch.tensor([[-25.0]]), torch.zeros(1, 1), "k2").item() == 312.5


@pytest.mark.parametrize("kind", sorted(KL_ESTIMATORS))
def test_kl_with_mask_never_reads_padding(kind):
    logp = torch.tensor([[0.5, NAN], [NAN, NAN]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])
    value = kl(logp, torch.zeros(2, 2), kind, mask=mask)
    aggregate(value, mask, "token-mean").backward()
    assert torch.isfinite(value).all() and (value[mask == 0] == 0).all()
    assert torch.isfinite(logp.grad).all() and (logp.grad[mask == 0] == 0).all()


def test_unknown_kl_estimator():
    assert check_kl_estimator("low_var_kl") == "low_var_kl"
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*'abs'.*'k1'.*'k2'.*'k3'.*'low_var_kl'"):
        kl(LOGP, REF, "k4")
    with pytest.raises(ValueError, match="'k4'"):
        check_kl_estimator("k4")
