"""Advantage estimators: GAE (PPO), GRPO, RLOO and REINFORCE++.

Shapes: `B` sequences, `T` response tokens; `mask` is `[B, T]`, 1 on real response tokens.
`rewards` is the token-level reward `[B, T]` (see `shaping.token_rewards`); `scores` is one
outcome reward per sequence `[B]`.

Advantages and returns are regression/policy-gradient *targets*, never differentiated, so every
estimator runs under `no_grad` (a value head's output passed as `values` must not leak a graph
into the returns).

The token recursions (GAE, REINFORCE++ returns) run over the masked tokens of each row: a token
with `mask == 0` is skipped, so "the next token" is the next masked one and everything past the
last masked token counts as 0. For right-padded masks this is exactly "0 past the end of the
row"; for masks with holes (e.g. tool output inside a response) the recursion bridges the hole.

Adding an estimator: write the function here, add one line to `ADVANTAGES` (the product's sharded adapters in
`estimators.py` are built from it by the function's parameter names).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .groups import GroupIds, group_moments
from .masked import masked_whiten
from .registry import lookup

Reduce = Callable[[Tensor], Tensor]  # a sum over every rank's share of a batch (the trainer's all-reduce)

__all__ = ["ADVANTAGES", "discounted_returns", "gae", "gae_unwhitened", "get_advantage", "grpo", "masked_whiten",
           "opd_advantages", "reinforce_pp", "rloo"]


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, *,
        reduce: Reduce | None = None) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, whitened over the batch's masked tokens.

    `delta_t = r_t + gamma * V_{t+1} - V_t` and `A_t = delta_t + gamma * lam * A_{t+1}`, from the last
    masked token backwards with `V` and `A` 0 past it. `returns = A + values` before whitening.

    Returns:
        `(advantages [B, T], returns [B, T])`; advantages whitened (`masked_whiten`, moments summed over ranks
        by `reduce` when the batch is split), both 0 where `mask == 0`.
    """
    advantages, returns = gae_unwhitened(rewards, values, mask, gamma, lam)
    return masked_whiten(advantages, mask, reduce=reduce), returns


@torch.no_grad()
def gae_unwhitened(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """`gae` before whitening: (advantages, returns), both 0 where `mask == 0`. Row by row independent, so a
    batch split over ranks can be whitened afterwards with moments of the whole batch."""
    keep = mask.bool()
    rewards = torch.where(keep, rewards, 0)
    values = torch.where(keep, values, 0)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = torch.zeros_like(next_value)
    columns = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        columns.append(torch.where(keep[:, t], advantage, 0))
        # Unmasked tokens are transparent: carry the next masked token's value and advantage over them.
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        next_advantage = torch.where(keep[:, t], advantage, next_advantage)
    advantages = torch.stack(columns[::-1], dim=1) if columns else torch.zeros_like(values)
    return advantages, advantages + values


def _as_float(scores: Tensor) -> Tensor:
    # 0/1 rewards often arrive as ints or bools; the maths below needs a float dtype.
    return scores if scores.is_floating_point() else scores.to(torch.get_default_dtype())


@torch.no_grad()
def grpo(scores: Tensor, group_ids: GroupIds, mask: Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantage: `(s - mean_g) / (std_g + eps)` (or `s - mean_g`), broadcast over `T`.

    `std_g` is the unbiased std. A group of one sample has mean 0 and std 1 (its score passes
    through, divided by `1 + eps`), so it is not silently zeroed. A group whose scores are all equal
    gets 0.

    Returns:
        `advantages [B, T]`: the per-sequence advantage times `mask`.
    """
    scores = _as_float(scores)
    inverse, count, mean, var = group_moments(scores, group_ids)
    singleton = count == 1
    mean = torch.where(singleton, 0, mean)
    advantage = scores - mean[inverse]
    if norm_by_std:
        std = torch.where(singleton, 1, var.sqrt())
        advantage = advantage / (std[inverse] + eps)
    return advantage[:, None] * mask


@torch.no_grad()
def rloo(scores: Tensor, group_ids: GroupIds, mask: Tensor) -> Tensor:
    """Leave-one-out baseline: `a_i = s_i * n/(n-1) - mean_g * n/(n-1)` for groups of `n > 1`.

    That is `s_i` minus the mean of the *other* samples of its group. A one-sample group has no
    baseline: `a = s`.

    Returns:
        `advantages [B, T]`: the per-sequence advantage times `mask`.
    """
    scores = _as_float(scores)
    inverse, count, mean, _ = group_moments(scores, group_ids)
    n = count[inverse]
    # clamp_min only keeps the n == 1 branch finite; torch.where discards it.
    scale = torch.where(n > 1, n / (n - 1).clamp_min(1), 1)
    baseline = torch.where(n > 1, mean[inverse], 0)
    advantage = scores * scale - baseline * scale
    return advantage[:, None] * mask


@torch.no_grad()
def reinforce_pp(rewards: Tensor, mask: Tensor, gamma: float, *, reduce: Reduce | None = None) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted returns-to-go, whitened over the batch's masked tokens.

    `returns_t = r_t + gamma * returns_{t+1}` over the masked tokens, 0 past the last one.

    Returns:
        `(advantages [B, T], returns [B, T])`; advantages are the whitened returns (moments summed over ranks
        by `reduce` when the batch is split), both 0 where `mask == 0`.
    """
    returns = discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask, reduce=reduce), returns


@torch.no_grad()
def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++'s returns before whitening, 0 where `mask == 0` (row by row independent)."""
    keep = mask.bool()
    rewards = torch.where(keep, rewards, 0)
    next_return = rewards.new_zeros(rewards.shape[0])
    columns = []
    for t in reversed(range(rewards.shape[1])):
        ret = rewards[:, t] + gamma * next_return
        columns.append(torch.where(keep[:, t], ret, 0))
        next_return = torch.where(keep[:, t], ret, next_return)
    return torch.stack(columns[::-1], dim=1) if columns else torch.zeros_like(rewards)


@torch.no_grad()
def opd_advantages(advantages: Tensor | None, student_logp: Tensor, teacher_logp: Tensor, mask: Tensor,
                   coef: float = 1.0) -> Tensor:
    """On-policy distillation (slime's formula): `(A - coef * (student_logp - teacher_logp)) * mask`.

    `student_logp` are the log-probs the student gave its own sampled tokens when it generated them (the
    batch's `old_logp`), `teacher_logp` a frozen teacher's log-probs of the same tokens in the same contexts.
    `advantages` is any estimator's `[B, T]` output, or None for pure distillation (`A = 0`). No clamp (a
    teacher log-prob of -60 is a large penalty, as it should be) and no whitening. Not an estimator (not in
    `ADVANTAGES`): a recipe applies it to the chosen estimator's output.

    Returns:
        `advantages [B, T]`, 0 where `mask == 0`, without gradient.
    """
    keep = mask.bool()
    gap = torch.where(keep, student_logp - teacher_logp, 0)
    base = 0 if advantages is None else torch.where(keep, advantages, 0)
    return torch.where(keep, base - coef * gap, 0) * mask


ADVANTAGES: dict[str, Callable[..., Tensor | tuple[Tensor, Tensor]]] = {
    "gae": gae,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}


def get_advantage(name: str) -> Callable[..., Tensor | tuple[Tensor, Tensor]]:
    """The advantage estimator registered as `name`; `ValueError` listing the known names otherwise."""
    return lookup(ADVANTAGES, name, kind="advantage estimator")
