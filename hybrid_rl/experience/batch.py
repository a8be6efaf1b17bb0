"""Advantages and the `TrainBatch` of this rank's share, and the step's reward / response metrics.

Outcome scores are per sample and known on every rank (`[N]`), so group estimators see the whole
batch; token-level inputs (KL in the reward, critic values) exist only for the share, and token
estimators whiten with moments summed over ranks (`algos.estimators`). No `[N, T]` tensor is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid_rl.algos import kl, overlong_penalty
from hybrid_rl.algos.estimators import AdvantageInputs, AdvantageSettings, get_estimator
from hybrid_rl.dist.collectives import all_reduce, all_reduce_max, all_reduce_sum
from hybrid_rl.experience.passes import PassOutputs, width_of
from hybrid_rl.experience.share import Share
from hybrid_rl.types import BatchIndex, Scores, TrainBatch


@dataclass(frozen=True)
class BatchSettings:
    estimator: str  # algorithm.advantage ("" for preference objectives: no advantages)
    advantage: AdvantageSettings
    kl_in_reward: bool
    kl_estimator: str
    max_new_tokens: int
    overlong_buffer: int
    overlong_penalty: float
    rm_weight: float


def global_rows(local: torch.Tensor, rows: torch.Tensor, size: int) -> torch.Tensor:
    """Per-sample values `[B]` of each rank's share, assembled into `[N]` on every rank (disjoint rows)."""
    out = torch.zeros(size, dtype=torch.float64)
    out[rows] = local.double()
    return all_reduce(out).float()


def outcome_scores(scores: Scores, passes: PassOutputs, share: Share, s: BatchSettings) -> torch.Tensor:
    """`[N]` outcome rewards: rule rewards + weighted reward model + DAPO's overlong shaping."""
    total = scores.total
    if passes.rm_scores is not None:
        total = total + s.rm_weight * global_rows(passes.rm_scores, share.rows, share.index.size)
    if s.overlong_buffer:
        total = total + overlong_penalty(share.index.response_lens, s.max_new_tokens, s.overlong_buffer,
                                         s.overlong_penalty)
    return total


def train_batch(share: Share, scores: torch.Tensor, passes: PassOutputs, s: BatchSettings, *,
                kl_coef: float) -> TrainBatch:
    """The share with its advantages (zeros for preference objectives) and returns."""
    samples = share.samples
    width = width_of(samples)
    mask = torch.arange(width)[None, :] < torch.tensor([x.response_len for x in samples], dtype=torch.long)[:, None]
    adv, returns = torch.zeros(len(samples), width), None
    if s.estimator:
        kl_tok = None
        if s.kl_in_reward and passes.ref_logp is not None:
            kl_tok = kl(passes.old_logp, passes.ref_logp, s.kl_estimator, mask=mask)
        x = AdvantageInputs(scores, share.index.groups, share.rows, mask, passes.values, kl_tok,
                            kl_coef if kl_tok is not None else 0.0, reduce=all_reduce)
        adv, returns = get_estimator(s.estimator)(x, s.advantage)
    return TrainBatch(samples, mask, scores[share.rows], passes.old_logp, adv, passes.ref_logp, passes.values,
                      returns, share.paired)


def reward_metrics(scored: Scores) -> dict[str, float]:
    s = scored.total
    out = {"reward/mean": float(s.mean()), "reward/std": float(s.std()) if len(s) > 1 else 0.0,
           "reward/min": float(s.min()), "reward/max": float(s.max()), "reward/errors": float(scored.errors),
           "reward/timeouts": float(scored.timeouts), "timing/reward_score_s": scored.seconds}
    for name, v in scored.parts.items():
        out[f"reward/{name}/mean"] = float(v.mean())
    return out


def rollout_metrics(index: BatchIndex, scores: torch.Tensor) -> dict[str, float]:
    lengths = index.response_lens.float()
    out = {"response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
           "response/clip_ratio": float(index.truncated.float().mean()), "reward/mean": float(scores.mean())}
    return {k: v for k, v in out.items() if math.isfinite(v)}


def logprob_diff_metrics(batch: TrainBatch, old_logp: torch.Tensor) -> dict[str, float]:
    """How far the training model's log-probs (this share) are from the sampler's. Collective."""
    total = count = peak = 0.0
    if batch.samples:
        sampled = torch.nn.utils.rnn.pad_sequence([s.rollout_logprobs for s in batch.samples], batch_first=True)
        width = min(sampled.shape[1], old_logp.shape[1])
        mask = batch.mask[:, :width]
        diff = torch.where(mask, (old_logp[:, :width] - sampled[:, :width]).abs(), 0)
        total, count, peak = float(diff.sum()), float(mask.sum()), float(diff.max()) if diff.numel() else 0.0
    total, count = all_reduce_sum([total, count])
    out = {"rollout/logprob_diff_mean": total / max(count, 1), "rollout/logprob_diff_max": all_reduce_max([peak])[0]}
    return {k: v for k, v in out.items() if math.isfinite(v)}


def kl_to_reference(batch: TrainBatch, old_logp: torch.Tensor, estimator: str) -> float:
    """Mean per-token KL of the pre-update policy to the reference over the whole batch. Collective."""
    k = kl(old_logp, batch.ref_logp, estimator, mask=batch.mask)
    total, count = all_reduce_sum([float(torch.where(batch.mask, k, 0).sum()), float(batch.mask.sum())])
    return total / max(count, 1.0)
