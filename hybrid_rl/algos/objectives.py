"""Training objectives: what one micro-batch's loss is, given the model's fresh log-probs.

An objective is a pure function of tensors; the trainer runs the model and passes the global
denominators (whole mini-batch, all ranks) so micro-batching never changes the result. Adding an
objective is one function plus one line in `OBJECTIVES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .losses import aggregate, dpo_loss, kl, policy_loss
from .masked import masked_mean
from .registry import lookup


@dataclass(frozen=True)
class ObjectiveSettings:
    loss_agg: str
    clip_low: float
    clip_high: float
    dual_clip: float | None
    kl_coef: float  # KL as a loss term (0 when the KL penalty is in the reward)
    kl_estimator: str
    entropy_coef: float
    dpo_beta: float
    dpo_kind: str
    dpo_label_smoothing: float


@dataclass(frozen=True)
class MicroInputs:
    """One micro-batch's tensors, `[b, T]` (rows and width matching `logp`)."""

    logp: Tensor
    entropy: Tensor | None
    mask: Tensor
    old_logp: Tensor
    advantages: Tensor
    ref_logp: Tensor | None
    pairs: Tensor | None  # [p, 2] local (chosen, rejected) rows, DPO only


def ppo_clip(x: MicroInputs, s: ObjectiveSettings, denoms: dict) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (+ KL to the reference as a loss term, - entropy bonus).

    The loss uses the mini-batch's global denominators; the reported stats are this micro-batch's
    token means (the trainer averages them, weighted by tokens).
    """
    denoms = {k: denoms[k] for k in ("num_tokens", "num_seqs", "horizon")}
    loss, stats = policy_loss(x.logp, x.old_logp, x.advantages, x.mask, s.clip_low, s.clip_high, s.dual_clip,
                              s.loss_agg, **denoms)
    with torch.no_grad():
        stats = dict(stats, pg_loss=policy_loss(x.logp, x.old_logp, x.advantages, x.mask, s.clip_low, s.clip_high,
                                                s.dual_clip, "token-mean")[0].item())
    if x.ref_logp is not None:
        k = kl(x.logp, x.ref_logp, s.kl_estimator, mask=x.mask)
        stats["kl"] = masked_mean(k.detach(), x.mask).item()
        if s.kl_coef:
            loss = loss + s.kl_coef * aggregate(k, x.mask, s.loss_agg, **denoms)
    if x.entropy is not None:
        stats["entropy"] = masked_mean(x.entropy.detach(), x.mask).item()
        if s.entropy_coef:
            loss = loss - s.entropy_coef * aggregate(x.entropy, x.mask, s.loss_agg, **denoms)
    return loss, stats


def dpo(x: MicroInputs, s: ObjectiveSettings, denoms: dict) -> tuple[Tensor, dict[str, float]]:
    """DPO on (chosen, rejected) pairs of this micro-batch; mean over all pairs of the mini-batch."""
    m = x.mask.to(x.logp.dtype)
    seq = (x.logp * m).sum(-1)
    ref = (x.ref_logp * m).sum(-1)
    c, r = x.pairs[:, 0], x.pairs[:, 1]
    losses, chosen_r, rejected_r = dpo_loss(seq[c], seq[r], ref[c], ref[r], s.dpo_beta, s.dpo_kind,
                                            s.dpo_label_smoothing)
    loss = losses.sum() / denoms["num_pairs"]
    stats = {"dpo_loss": loss.item(), "reward_margin": (chosen_r - rejected_r).mean().item() if len(c) else 0.0,
             "reward_accuracy": (chosen_r > rejected_r).float().mean().item() if len(c) else 0.0}
    return loss, stats


Objective = Callable[[MicroInputs, ObjectiveSettings, dict], tuple[Tensor, dict[str, float]]]
OBJECTIVES: dict[str, Objective] = {"ppo_clip": ppo_clip, "dpo": dpo}


def get_objective(name: str) -> Objective:
    return lookup(OBJECTIVES, name, kind="objective")


def zero_like_loss(logp: Tensor) -> Tensor:
    """A zero loss connected to the graph (a rank with nothing to train must still join FSDP's backward)."""
    return (logp * 0).sum() if logp.numel() else torch.zeros((), requires_grad=True)
