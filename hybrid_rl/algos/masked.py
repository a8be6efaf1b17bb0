"""Masked reductions over response tokens.

Shapes: `B` sequences, `T` response tokens; `mask` is a bool or float `[B, T]` tensor, 1 on real
response tokens (a float mask acts as weights, as in `sum(values * mask)`).

Everything here *selects* with `torch.where` before it multiplies by the mask, because
`nan * 0 == nan`: values under `mask == 0` (padding, prompt positions, garbage from a kernel) are
never read, so they can reach neither a result nor a gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

WHITEN_EPS = 1e-8


def masked_select_zero(values: Tensor, mask: Tensor) -> Tensor:
    """`values * mask`, except that positions with `mask == 0` are exactly 0 even if `values` is NaN there."""
    return torch.where(mask.bool(), values, 0) * mask


def safe_denominator(denominator: Tensor) -> Tensor:
    """Replace a zero count by 1: the matching numerator is an empty sum (0), so the result is 0, not NaN.

    (Dividing first and selecting after would leave `0/0` in the backward pass.)
    """
    return torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values * mask` over `dim` (all dims when None)."""
    selected = masked_select_zero(values, mask)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """`sum(values * mask) / sum(mask)` over `dim` (all dims when None); 0 where the mask is empty."""
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(values, mask, dim) / safe_denominator(count)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries (all dims), unbiased (`n - 1`) by default.

    With fewer than two masked entries the unbiased variance is undefined (0/0); it is defined here
    as 0, so that whitening a single token gives 0 instead of NaN.
    """
    n = mask.to(values.dtype).sum()
    mean = masked_mean(values, mask)
    # Two-pass (deviations from the mean) rather than E[x^2] - E[x]^2, which cancels badly.
    squared_dev = masked_sum((values - mean) ** 2, mask)
    return squared_dev / safe_denominator(n - 1 if unbiased else n)


def masked_whiten(values: Tensor, mask: Tensor, *, eps: float = WHITEN_EPS,
                  reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """`(values - mean) / sqrt(var + eps)` over the masked entries, zero where `mask == 0`.

    The mean is the masked mean, the variance the unbiased masked variance (`masked_var`). An
    all-masked input or a single masked entry gives zeros.

    `reduce` sums a small tensor over every part of a batch split between processes (the trainer
    passes an all-reduce): the moments are then those of the whole batch, while `values` is this
    process's part. None: `values` is the whole batch.
    """
    reduce = reduce or (lambda t: t)
    keep = mask.bool()
    values = torch.where(keep, values, 0)
    total, n = reduce(torch.stack([masked_sum(values, mask), mask.to(values.dtype).sum()]))
    mean = total / safe_denominator(n)
    squared_dev = reduce(masked_sum((values - mean) ** 2, mask)[None])[0]
    var = squared_dev / safe_denominator(n - 1)
    return torch.where(keep, (values - mean) / torch.sqrt(var + eps), 0)


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """`1 - Var[R - V] / Var[R]` over the masked tokens: how much of the return the critic explains.

    1 is a perfect critic, 0 no better than a constant, negative worse than a constant. When
    `Var[R] == 0` there is nothing to explain and the result is 0 (not -inf or NaN). A 0-dim
    tensor; a diagnostic, so no gradient.
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    return torch.where(var_returns > 0, 1 - var_residual / safe_denominator(var_returns), 0)
