"""`aggregate` modes by hand, and micro-batch invariance with global denominators."""

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import POLICY_LOSS_AGG, aggregate, loss_denominators, policy_loss, value_loss

NAN = float("nan")

# Row 0: three tokens [1, 2, 3]; row 1: one token [4]; row 2: empty (all NaN, never read).
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN], [NAN, NAN, NAN]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-mean", 3.0),  # row means [2, 4] (empty row skipped) -> (2 + 4) / 2
        ("seq-mean-token-sum", 5.0),  # row sums [6, 4] (empty row skipped) -> (6 + 4) / 2
        ("seq-mean-token-sum-norm", 10.0 / 3),  # (1 + 2 + 3 + 4) / T, T = 3
    ],
)
def test_aggregate_modes_by_hand(mode, expected):
    assert_close(aggregate(VALUES, MASK, mode), torch.tensor(expected))


@pytest.mark.parametrize("mode", sorted(POLICY_LOSS_AGG))
def test_aggregate_all_masked_is_zero_with_zero_gradient(mode):
    values = torch.full((2, 3), NAN, requires_grad=True)
    loss = aggregate(values, torch.zeros(2, 3), mode)
    loss.backward()
    assert_close(loss, torch.tensor(0.0))
    assert_close(values.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("mode", sorted(POLICY_LOSS_AGG))
def test_aggregate_gradient_is_zero_under_the_mask(mode):
    values = VALUES.clone().requires_grad_()
    aggregate(values, MASK, mode).backward()
    assert torch.isfinite(values.grad).all()
    assert (values.grad[MASK == 0] == 0).all()
    assert (values.grad[MASK == 1] > 0).all()


def test_aggregate_explicit_denominators():
    # token-mean with num_tokens=8: 10 / 8; seq modes with num_seqs=4: row means 6/4, row sums 10/4;
    # sum-norm with horizon=5: 10 / 5. Each mode ignores the other keywords.
    counts = {"num_tokens": 8, "num_seqs": torch.tensor(4.0), "horizon": 5}
    assert_close(aggregate(VALUES, MASK, "token-mean", **counts), torch.tensor(1.25))
    assert_close(aggregate(VALUES, MASK, "seq-mean-token-mean", **counts), torch.tensor(1.5))
    assert_close(aggregate(VALUES, MASK, "seq-mean-token-sum", **counts), torch.tensor(2.5))
    assert_close(aggregate(VALUES, MASK, "seq-mean-token-sum-norm", **counts), torch.tensor(2.0))


def test_loss_denominators_count_tokens_and_nonempty_rows():
    counts = loss_denominators(MASK)
    assert counts["num_tokens"].item() == 4 and counts["num_seqs"].item() == 2


def test_unknown_mode_lists_known_modes():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'.*'token-mean'"):
        aggregate(VALUES, MASK, "mean")


# ---------------------------------------------------------------------------------------------
# Micro-batch invariance: a mini-batch of 5 right-padded rows (one empty) split into micro-batches
# that are each trimmed to their own width, as a collator would. With the mini-batch's counts passed
# in, the micro-batch losses sum to the mini-batch loss and the gradients match.
# ---------------------------------------------------------------------------------------------

LENGTHS = [6, 2, 0, 4, 1]
HORIZON = 6
SPLITS = [(0, 2), (2, 3), (3, 5)]


def _minibatch():
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(HORIZON)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    logp = (-torch.rand(5, HORIZON, generator=g)).masked_fill(mask == 0, NAN)
    old_logp = logp + 0.3 * torch.randn(5, HORIZON, generator=g)
    advantages = torch.randn(5, HORIZON, generator=g)
    return mask, logp, old_logp, advantages


def _micro(tensor, start, stop, mask):
    width = max(int(mask[start:stop].sum(-1).max()), 1)
    return tensor[start:stop, :width]


@pytest.mark.parametrize("mode", sorted(POLICY_LOSS_AGG))
def test_policy_loss_micro_batches_sum_to_the_mini_batch(mode):
    mask, logp0, old_logp, advantages = _minibatch()
    counts = {**loss_denominators(mask), "horizon": HORIZON}

    logp = logp0.clone().requires_grad_()
    whole, _ = policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28, 3.0, mode, **counts)
    whole.backward()
    whole_grad = logp.grad.clone()

    logp = logp0.clone().requires_grad_()
    total = torch.tensor(0.0)
    for start, stop in SPLITS:
        part = [_micro(t, start, stop, mask) for t in (logp, old_logp, advantages, mask)]
        loss, _ = policy_loss(*part, 0.2, 0.28, 3.0, mode, **counts)
        loss.backward()
        total = total + loss.detach()

    assert_close(total, whole.detach())
    assert_close(logp.grad, whole_grad)
    assert torch.isfinite(whole_grad).all() and (whole_grad[mask == 0] == 0).all()


def test_micro_batching_without_global_counts_differs():
    # The control: with each micro-batch's own counts, the summed losses are not the mini-batch loss.
    mask, logp, old_logp, advantages = _minibatch()
    whole, _ = policy_loss(logp, old_logp, advantages, mask)
    parts = [policy_loss(*[_micro(t, a, b, mask) for t in (logp, old_logp, advantages, mask)])[0] for a, b in SPLITS]
    assert not torch.allclose(sum(parts), whole)


@pytest.mark.parametrize("mode", sorted(POLICY_LOSS_AGG))
def test_value_loss_micro_batches_sum_to_the_mini_batch(mode):
    mask, values0, old_values, returns = _minibatch()
    counts = {**loss_denominators(mask), "horizon": HORIZON}

    values = values0.clone().requires_grad_()
    whole, _ = value_loss(values, old_values, returns, mask, 0.2, mode, **counts)
    whole.backward()
    whole_grad = values.grad.clone()

    values = values0.clone().requires_grad_()
    total = torch.tensor(0.0)
    for start, stop in SPLITS:
        part = [_micro(t, start, stop, mask) for t in (values, old_values, returns, mask)]
        loss, _ = value_loss(*part, 0.2, mode, **counts)
        loss.backward()
        total = total + loss.detach()

    assert_close(total, whole.detach())
    assert_close(values.grad, whole_grad)
