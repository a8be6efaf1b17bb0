"""Losses: token aggregation, KL estimators, PPO / GSPO / CISPO policy losses, value loss, entropy, DPO.

Shapes: `B` sequences, `T` response tokens, `V` vocabulary; `mask` is bool or float `[B, T]`, 1 on
real response tokens. Inputs under `mask == 0` are never read (they are replaced by 0 before any
arithmetic, so NaN padding reaches neither the loss nor a gradient).

Micro-batching: with the defaults, `aggregate` normalises by the counts of the tensors it is given,
so the gradient of a micro-batch loss depends on how the mini-batch was split. Pass the
mini-batch's counts (`loss_denominators(minibatch_mask)`, summed/all-reduced by the trainer) as
`num_tokens=`, `num_seqs=`, `horizon=`; then the micro-batch losses sum to the mini-batch loss and
their gradients add up to its gradient. Each mode reads only its own denominator, so a trainer can
pass all three without knowing the mode. (With data parallelism the counts are all-reduced; FSDP then
*averages* gradients over ranks, so scale the loss by the world size to keep the global sum.)

Adding a KL estimator, aggregation mode or DPO kind: one function plus one line in its registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .masked import masked_mean, masked_select_zero, masked_sum, safe_denominator
from .preference import DPO_LOSSES, dpo_loss
from .registry import lookup
from .surrogates import Surrogate, cispo_surrogate, clipped_surrogate, gspo_surrogate

__all__ = [
    "AGGREGATIONS",
    "DPO_LOSSES",
    "Denominators",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "POLICY_LOSS_AGG",
    "aggregate",
    "check_kl_estimator",
    "check_loss_agg",
    "cispo_loss",
    "clipped_surrogate",
    "dpo_loss",
    "entropy_from_logits",
    "get_policy_loss",
    "gspo_loss",
    "kl",
    "loss_denominators",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "value_loss",
]

Count = float | Tensor

# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------


class Denominators(NamedTuple):
    """Global denominators passed in from outside (None: use this batch's own count)."""

    num_tokens: Count | None = None
    num_seqs: Count | None = None
    horizon: Count | None = None


def _count(given: Count | None, local: Tensor) -> Tensor:
    """The caller's global count if given, else the local one; 0 becomes 1 (its numerator is an empty sum)."""
    count = local if given is None else torch.as_tensor(given, dtype=local.dtype, device=local.device)
    return safe_denominator(count)


def _nonempty_rows(weight: Tensor) -> Tensor:
    return (weight.sum(-1) > 0).to(weight.dtype).sum()


def _token_mean(x: Tensor, weight: Tensor, given: Denominators) -> Tensor:
    return x.sum() / _count(given.num_tokens, weight.sum())


def _seq_mean_token_mean(x: Tensor, weight: Tensor, given: Denominators) -> Tensor:
    # An empty row's mean is 0/1 = 0 and it is not among the non-empty rows: skipped.
    row_means = x.sum(-1) / safe_denominator(weight.sum(-1))
    return row_means.sum() / _count(given.num_seqs, _nonempty_rows(weight))


def _seq_mean_token_sum(x: Tensor, weight: Tensor, given: Denominators) -> Tensor:
    return x.sum() / _count(given.num_seqs, _nonempty_rows(weight))


def _seq_mean_token_sum_norm(x: Tensor, weight: Tensor, given: Denominators) -> Tensor:
    # Dr. GRPO: a constant denominator, so every token weighs the same whatever its response's length.
    width = torch.tensor(float(x.shape[-1]), dtype=x.dtype, device=x.device)
    return x.sum() / _count(given.horizon, width)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, Denominators], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
POLICY_LOSS_AGG: frozenset[str] = frozenset(AGGREGATIONS)


def check_loss_agg(mode: str) -> str:
    """Return `mode` if it is a known aggregation mode, else raise `ValueError` listing them."""
    lookup(AGGREGATIONS, mode, kind="loss aggregation mode")
    return mode


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    horizon: Count | None = None,
) -> Tensor:
    """Reduce per-token `values [B, T]` to a scalar loss.

    Modes: `token-mean` = sum(values*mask)/sum(mask); `seq-mean-token-mean` = mean over rows of each
    row's token mean; `seq-mean-token-sum` = mean over rows of each row's token sum;
    `seq-mean-token-sum-norm` = sum(values*mask)/T (Dr. GRPO, T = the mask's width). Rows with an
    empty mask are skipped in the seq-means; an all-empty mask gives 0.

    Args:
        values: per-token values `[B, T]`; never read where `mask == 0`.
        mask: `[B, T]`, 1 on real tokens.
        mode: one of `POLICY_LOSS_AGG`.
        num_tokens: replaces sum(mask) in `token-mean` (the whole mini-batch's token count).
        num_seqs: replaces the number of non-empty rows in the two `seq-mean-token-*` modes.
        horizon: replaces T in `seq-mean-token-sum-norm` (e.g. the configured max response length,
            since micro-batches may be padded to different widths).
    """
    reduce = lookup(AGGREGATIONS, mode, kind="loss aggregation mode")
    weight = mask.to(values.dtype)
    return reduce(masked_select_zero(values, mask), weight, Denominators(num_tokens, num_seqs, horizon))


def loss_denominators(mask: Tensor) -> dict[str, Tensor]:
    """Counts of one (micro-)batch for `aggregate`'s keywords: `num_tokens` and `num_seqs` (non-empty rows).

    Sum these over the micro-batches (and all-reduce over data-parallel ranks) of a mini-batch and pass
    them to every micro-batch's loss. `horizon` is not a count: pass a constant (the max response length).
    """
    tokens_per_row = mask.to(torch.float32).sum(-1)
    return {"num_tokens": tokens_per_row.sum(), "num_seqs": (tokens_per_row > 0).to(torch.float32).sum()}


# ---------------------------------------------------------------------------------------------
# KL estimators of KL(pi || ref) from samples of pi, as functions of d = logp - ref_logp
# ---------------------------------------------------------------------------------------------


def _kl_k3(d: Tensor) -> Tensor:
    # Schulman's k3, unbiased and always >= 0. Clamping d first keeps exp() finite, so the backward pass
    # has no 0 * inf; the result clamp bounds the loss from a few wild tokens. expm1 is exp(-d) - 1
    # without the cancellation near d = 0.
    d = d.clamp(-20, 20)
    return (torch.expm1(-d) + d).clamp(-10, 10)


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda d: d,
    "abs": torch.abs,
    "k2": lambda d: 0.5 * d * d,
    "k3": _kl_k3,
    "low_var_kl": _kl_k3,
}


def check_kl_estimator(kind: str) -> str:
    """Return `kind` if it is a known KL estimator, else raise `ValueError` listing them."""
    lookup(KL_ESTIMATORS, kind, kind="KL estimator")
    return kind


def kl(logp: Tensor, ref_logp: Tensor, kind: str, *, mask: Tensor | None = None) -> Tensor:
    """Per-token estimate `[B, T]` of KL(pi || ref) with `d = logp - ref_logp`.

    `k1` = d; `abs` = |d|; `k2` = 0.5 d^2; `k3`/`low_var_kl` = exp(-d) - 1 + d with d clamped to
    [-20, 20] and the result to [-10, 10]. Only k3 is clamped (the others are exact estimators).
    With `mask`, positions where `mask == 0` are not read and come out 0 (value and gradient).
    """
    estimator = lookup(KL_ESTIMATORS, kind, kind="KL estimator")
    if mask is None:
        return estimator(logp - ref_logp)
    keep = mask.bool()
    return torch.where(keep, estimator(torch.where(keep, logp - ref_logp, 0)), 0)


# ---------------------------------------------------------------------------------------------
# PPO losses
# ---------------------------------------------------------------------------------------------


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    *,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    horizon: Count | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, with asymmetric clipping (DAPO clip-higher) and optional dual clip.

    `ratio = exp(clamp(logp - old_logp, -20, 20))`,
    `l = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))`; with `dual_clip = c > 1`,
    `l = min(l, -A * c)` where `A < 0` (a huge ratio on a bad token cannot blow up the loss).

    Returns:
        `(aggregate(l, mask, agg, ...), stats)`; stats (local to this batch, python floats):
        `clip_frac` (share of masked tokens where the clipped term was larger), `approx_kl`
        (masked mean of `old_logp - logp`), `dual_clip_frac` (share where the dual clip bound).
    """
    check_loss_agg(agg)
    t = clipped_surrogate(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip)
    loss = aggregate(t.per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    return loss, {k: float(v) for k, v in t.stats(mask).items()}


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    *,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    horizon: Count | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Group Sequence Policy Optimization), token-level form with stop-gradient ("GSPO-token").

    Per row, `log_s` = the masked mean of `logp - old_logp` (raw, unclamped; 0 for an empty row). Per token,
    `log_r_t = min(sg[log_s] + logp_t - sg[logp_t], 10)`, `r_t = exp(log_r_t)`: every token of a row has the
    value `min(s, e^10)`, and `d r_t / d logp_t = r_t` (0 past the clamp), nothing through `s` or `old_logp`.
    `l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))`; with `A` constant along a row this is
    sequence-level GSPO, value and gradient.

    Returns:
        `(aggregate(l, mask, agg, ...), stats)`: `clip_frac` (share of masked tokens where the clipped term was
        strictly larger), `approx_kl` (masked mean of `old_logp - logp`), python floats.
    """
    check_loss_agg(agg)
    t = gspo_surrogate(logp, old_logp, advantages, mask, clip_low, clip_high)
    return _aggregated(t, mask, agg, num_tokens, num_seqs, horizon)


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float | None = None,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    *,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    horizon: Count | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1): REINFORCE weighted by a clipped, detached importance weight.

    `ratio = exp(clamp(logp - old_logp, -20, 20))`, `w = clip(ratio, 1 - clip_low, 1 + clip_high)` (no lower
    bound with `clip_low=None`), `l_t = -sg[w_t] A_t logp_t`: `d l_t / d logp_t = -w_t A_t`, so a clipped token
    keeps its gradient. `clip_high = 4.0` is TRL's / ScaleRL's absolute cap `epsilon_high = 5.0`.

    Returns:
        `(aggregate(l, mask, agg, ...), stats)`: `clip_frac` (share of masked tokens whose ratio lies outside
        the bounds, whatever the sign of `A`), `approx_kl` (masked mean of `old_logp - logp`), python floats.
    """
    check_loss_agg(agg)
    t = cispo_surrogate(logp, old_logp, advantages, mask, clip_low, clip_high)
    return _aggregated(t, mask, agg, num_tokens, num_seqs, horizon)


def _aggregated(t: Surrogate, mask: Tensor, agg: str, num_tokens: Count | None, num_seqs: Count | None,
                horizon: Count | None) -> tuple[Tensor, dict[str, float]]:
    loss = aggregate(t.per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    stats = t.stats(mask)
    return loss, {k: float(stats[k]) for k in ("clip_frac", "approx_kl")}


# Policy losses by the names recipes use (spec: "ppo", "gspo", "cispo"); the same inputs, alternatives to each other.
POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, float]]]] = {
    "ppo": policy_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """The policy loss registered as `name`; `ValueError` listing the known names otherwise."""
    return lookup(POLICY_LOSSES, name, kind="policy loss")


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float = 0.5,
    agg: str = "token-mean",
    *,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    horizon: Count | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss `0.5 * max((v - R)^2, (clip(v, old_v - clip, old_v + clip) - R)^2)`, aggregated.

    Returns:
        `(loss, stats)`; `stats["clip_frac"]`: share of masked tokens where the clipped term was larger.
    """
    check_loss_agg(agg)
    per_token, clipped = value_loss_terms(values, old_values, returns, mask, clip)
    loss = aggregate(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    return loss, {"clip_frac": masked_mean(clipped.float(), mask).item()}


def value_loss_terms(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                     clip: float) -> tuple[Tensor, Tensor]:
    """`value_loss`'s per-token loss `[B, T]` and where the clipped term was larger (bool, detached)."""
    keep = mask.bool()
    values = torch.where(keep, values, 0)
    old_values = torch.where(keep, old_values, 0)
    returns = torch.where(keep, returns, 0)
    # clamp returns v itself (not old_v + (v - old_v)) when in range, so the unclipped branch is exact.
    values_clipped = torch.clamp(values, old_values - clip, old_values + clip)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of `softmax(logits)` along the last axis: `[..., V] -> [...]`.

    `-sum(p * log_softmax)` with `log_softmax` computed through logsumexp: finite for huge finite
    logits, and, unlike `logsumexp(z) - sum(p * z)`, without cancelling two large numbers. Expects
    finite logits (mask vocabulary padding with a large negative number, not -inf: `0 * -inf` is NaN).
    """
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)
