"""Per-token policy-gradient surrogates, before aggregation: PPO's clipped ratio, GSPO's sequence ratio, CISPO's
clipped detached weight. `losses.policy_loss`, `gspo_loss` and `cispo_loss` aggregate them; the trainer's
objectives (`objectives.py`) reweight them (rollout correction) before aggregating with global denominators.

Shapes: `B` sequences, `T` response tokens; `mask` `[B, T]`, 1 on real tokens. Every input is selected with the
mask before any arithmetic, so values under `mask == 0` reach neither a result nor a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .masked import masked_mean, safe_denominator

GSPO_MAX_LOG_RATIO = 10.0  # exp(10) ~ 2.2e4: bounds the sequence ratio (and zeroes its gradient beyond)


@dataclass(frozen=True)
class Surrogate:
    """A policy loss's per-token terms, before aggregation."""

    per_token: Tensor  # [B, T] the per-token loss
    clipped: Tensor  # [B, T] bool: the clip bound (PPO/GSPO: the clipped term was the larger; CISPO: w != ratio)
    dual_bound: Tensor  # [B, T] bool: the dual clip bound (PPO only; all False otherwise)
    log_ratio: Tensor  # [B, T] logp - old_logp (0 outside the mask)

    @torch.no_grad()
    def stats(self, mask: Tensor) -> dict[str, Tensor]:
        """0-d tensors (no host sync): clip_frac, approx_kl, dual_clip_frac over the masked tokens."""
        return {"clip_frac": masked_mean(self.clipped.float(), mask),
                "approx_kl": masked_mean(-self.log_ratio.detach().float(), mask),
                "dual_clip_frac": masked_mean(self.dual_bound.float(), mask)}


def clipped_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                      clip_high: float, dual_clip: float | None) -> Surrogate:
    """The per-token PPO surrogate of `policy_loss` (see there)."""
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    keep = mask.bool()
    log_ratio = torch.where(keep, logp - old_logp, 0)
    advantages = torch.where(keep, advantages, 0)
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_bound = torch.zeros_like(keep)
    if dual_clip is not None:
        dual_bound = (advantages < 0) & (per_token > -advantages * dual_clip)
        per_token = torch.where(dual_bound, -advantages * dual_clip, per_token)
    return Surrogate(per_token, (clipped > unclipped).detach(), dual_bound, log_ratio)


def gspo_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                   clip_high: float) -> Surrogate:
    """The per-token GSPO-token surrogate of `gspo_loss` (see there).

    The sequence log-ratio is each row's masked mean, so a row must hold a whole sequence: the trainer's
    micro-batches are cut between samples, never through one, and scatter each sample to its own row.
    """
    keep = mask.bool()
    logp = torch.where(keep, logp, 0)
    log_ratio = torch.where(keep, logp - old_logp, 0)
    advantages = torch.where(keep, advantages, 0)
    n = safe_denominator(keep.to(log_ratio.dtype).sum(-1))
    log_seq_ratio = (log_ratio.sum(-1) / n).detach()  # an empty row: 0/1 = 0, ratio 1
    # Value: the row's sequence ratio on every token; gradient: d r_t / d logp_t = r_t, through the token only.
    log_r = (log_seq_ratio[:, None] + logp - logp.detach()).clamp(max=GSPO_MAX_LOG_RATIO)
    ratio = torch.exp(log_r)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    return Surrogate(per_token, (clipped > unclipped).detach(), torch.zeros_like(keep), log_ratio)


def cispo_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float | None,
                    clip_high: float) -> Surrogate:
    """The per-token CISPO term of `cispo_loss` (see there): `-sg[w] * A * logp`, `w` the clipped ratio."""
    keep = mask.bool()
    logp = torch.where(keep, logp, 0)
    log_ratio = torch.where(keep, logp - old_logp, 0)
    advantages = torch.where(keep, advantages, 0)
    ratio = torch.exp(log_ratio.detach().clamp(-20, 20))
    low = None if clip_low is None else 1 - clip_low
    weight = ratio.clamp(min=low, max=1 + clip_high)
    outside = ratio > 1 + clip_high
    if low is not None:
        outside = outside | (ratio < low)
    per_token = -weight * advantages * logp
    return Surrogate(per_token, outside & keep, torch.zeros_like(keep), log_ratio)

