"""Advantages and the `TrainBatch` of this rank's share, and the step's reward / response / sampler-mismatch metrics.

Outcome scores are per sample and known on every rank (`[N]`), so group estimators see the whole
batch; token-level inputs (KL in the reward, critic values) exist only for the share, and token
estimators whiten with moments summed over ranks (`algos.estimators`). No `[N, T]` tensor is built.

A black-box agent's episode may be several samples (`BatchIndex.episodes`): each gets the score of the episode's
last sample (what the reward functions judged), group estimators count the episode once, and the reward metrics are
means over episodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid_rl.algos import aggregate, kl, masked_sum, opd_advantages, overlong_penalty
from hybrid_rl.algos.correction import CorrectionInputs, CorrectionSettings, rollout_correction, token_log_ratio
from hybrid_rl.algos.estimators import AdvantageInputs, AdvantageSettings, get_estimator
from hybrid_rl.algos.groups import episode_rows
from hybrid_rl.algos.shaping import turn_reward_tokens
from hybrid_rl.distributed.collectives import all_reduce, all_reduce_sum
from hybrid_rl.experience.passes import PassOutputs, width_of
from hybrid_rl.experience.share import Share
from hybrid_rl.types import BatchIndex, Sample, Scores, TrainBatch


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
    opd_coef: float = 0.0  # on-policy distillation (with the teacher's log-probs in the passes)
    distil_only: bool = False  # no reward at all: the advantages are the distillation term alone


def global_rows(local: torch.Tensor, rows: torch.Tensor, size: int) -> torch.Tensor:
    """Per-sample values `[B]` of each rank's share, assembled into `[N]` on every rank (disjoint rows)."""
    out = torch.zeros(size, dtype=torch.float64)
    out[rows] = local.double()
    return all_reduce(out).float()


def outcome_scores(scores: Scores, passes: PassOutputs, share: Share, s: BatchSettings) -> torch.Tensor:
    """`[N]` outcome rewards: rule rewards + weighted reward model + DAPO's overlong shaping; every sample of an
    episode gets its last sample's (the episode's outcome)."""
    total = scores.total
    if passes.rm_scores is not None:
        total = total + s.rm_weight * global_rows(passes.rm_scores, share.rows, share.index.size)
    if s.overlong_buffer:
        # the model's own tokens: a multi-turn response's tool results and template tokens are not its length
        total = total + overlong_penalty(share.index.own_lens, s.max_new_tokens, s.overlong_buffer,
                                         s.overlong_penalty)
    if (episodes := share.index.episodes) is not None:
        last, inverse = episode_rows(episodes)
        total = total[last][inverse]
    return total


def train_batch(share: Share, scores: torch.Tensor, passes: PassOutputs, s: BatchSettings, *,
                kl_coef: float, version: int) -> TrainBatch:
    """The share with its advantages (zeros for preference objectives) and returns; `version` is the policy version
    it trains (the optimizer steps taken so far), against which each token's staleness is counted."""
    samples = share.samples
    width = width_of(samples)
    mask = loss_mask(samples, width)
    adv, returns = torch.zeros(len(samples), width), None
    if s.estimator:
        kl_tok = None
        if s.kl_in_reward and passes.ref_logp is not None:
            kl_tok = kl(passes.old_logp, passes.ref_logp, s.kl_estimator, mask=mask)
        x = AdvantageInputs(scores, share.index.groups, share.rows, mask, passes.values, kl_tok,
                            kl_coef if kl_tok is not None else 0.0, reduce=all_reduce, episodes=share.index.episodes,
                            turn_rewards=per_turn_rewards(samples, mask) if share.index.episodes is None else None)
        adv, returns = get_estimator(s.estimator)(x, s.advantage)
    if passes.teacher_logp is not None and s.opd_coef:
        assert passes.old_logp is not None, "distillation needs the student's log-probs before the update"
        adv = opd_advantages(None if s.distil_only else adv, passes.old_logp, passes.teacher_logp, mask, s.opd_coef)
    return TrainBatch(samples, mask, scores[share.rows], passes.old_logp, adv, passes.ref_logp, passes.values,
                      returns, share.paired, sampler_logprobs(samples, width), token_staleness(samples, width, version),
                      passes.teacher_logp)


def per_turn_rewards(samples: list[Sample], mask: torch.Tensor) -> torch.Tensor | None:
    """`[B, T]` the environment's step rewards on their model turns' last tokens (`turn_reward_tokens`), for the
    samples whose outcome includes them (`env_reward`: the environment's final reward plus the sum of its turns'),
    so that the token estimators give each turn's reward to that turn and the ones before; None when no sample has
    any."""
    per_turn = [x.fields.get("turn_rewards") if "env_reward" in x.fields else None for x in samples]
    if not any(r and any(r) for r in per_turn):
        return None
    return turn_reward_tokens(mask, per_turn)


def loss_mask(samples: list[Sample], width: int) -> torch.Tensor:
    """`[B, width]` bool: the tokens the loss covers: every real response token, less a multi-turn sample's context
    (tool results, template tokens: `Sample.loss_mask`)."""
    mask = torch.arange(width)[None, :] < torch.tensor([x.response_len for x in samples], dtype=torch.long)[:, None]
    for i, x in enumerate(samples):
        if x.loss_mask.numel():
            mask[i, : x.response_len] &= x.loss_mask
    return mask


def sampler_logprobs(samples: list[Sample], width: int) -> torch.Tensor | None:
    """The sampler's log-probs `[B, width]`, 0-padded; None when the samples have none (offline pairs)."""
    if any(s.rollout_logprobs.shape[0] != s.response_len for s in samples):
        return None
    out = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        out[i, : s.response_len] = s.rollout_logprobs
    return out


def token_staleness(samples: list[Sample], width: int, version: int) -> torch.Tensor | None:
    """`[B, width]` int64: `version` minus the policy version that sampled each token, 0-padded; None when the
    samples carry no versions (every token then came from the weights being trained)."""
    if not any(s.token_versions.numel() for s in samples):
        return None
    out = torch.zeros(len(samples), width, dtype=torch.int64)
    for i, s in enumerate(samples):
        if s.token_versions.numel():
            out[i, : s.response_len] = version - s.token_versions
    return out


def reward_metrics(scored: Scores, index: BatchIndex) -> dict[str, float]:
    """The reward functions' statistics over the step's episodes (each judged on its last sample)."""
    ends = index.episode_ends
    s = scored.total[ends]
    out = {"reward/mean": float(s.mean()), "reward/std": float(s.std()) if len(s) > 1 else 0.0,
           "reward/min": float(s.min()), "reward/max": float(s.max()), "reward/errors": float(scored.errors),
           "reward/timeouts": float(scored.timeouts), "timing/reward_score_s": scored.seconds}
    for name, v in scored.parts.items():
        out[f"reward/{name}/mean"] = float(v[ends].mean())
    return out


def rollout_metrics(index: BatchIndex, scores: torch.Tensor) -> dict[str, float]:
    lengths = index.response_lens.float()
    out = {"response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
           "response/clip_ratio": float(index.truncated.float().mean()),
           "reward/mean": float(scores[index.episode_ends].mean()), "train/samples": float(index.size)}
    return {k: v for k, v in out.items() if math.isfinite(v)}


def mismatch_metrics(batch: TrainBatch, old_logp: torch.Tensor, correction: CorrectionSettings, *,
                     max_staleness: int = 0) -> dict[str, float]:
    """How far the training model's pre-update log-probs are from the sampler's, and what the rollout
    correction did about it: token means and maxima over the whole batch (all ranks). Collective.

    `rollout/logprob_diff_{mean,max}`: |old - rollout| per token. `rollout_correction/`:
    `is_ratio_{mean,max}`: the ratio at the correction's level, before truncation or masking (under
    `none`, at its level too); `truncated_frac`, `masked_frac`: shares of the tokens; `kl_k1`,
    `kl_k3`: KL(rollout || train) estimated on the sampled tokens, mean(rollout - old) and
    mean(rho - 1 - log rho) (>= 0, each token's term clamped as `algos.kl` does).

    With per-token staleness (asynchronous runs, `batch.staleness`), `async/staleness_tokens_{d}` for
    d = 0..`max_staleness` is the share of tokens sampled d policy versions ago (the histogram),
    `async/staleness_tokens_mean` / `_max` its mean and maximum, and `async/is_ratio_mean_{d}` the mean
    IS ratio of those tokens (how far the sampler's policy drifted from the trained one, by age), and
    `rollout/logprob_diff_mean_own` the mean |old - rollout| over the tokens sampled by the weights being
    trained (age 0): the sync's end-to-end check, which older tokens would blur (`trainer.max_logprob_diff`).
    """
    mask = batch.mask
    assert batch.rollout_logp is not None, "mismatch metrics need the sampler's log-probs"
    x = CorrectionInputs(old_logp, batch.rollout_logp, mask, batch.staleness)
    c, log_rho = rollout_correction(x, correction), token_log_ratio(x)
    k3 = kl(torch.zeros_like(log_rho), log_rho, "k3", mask=mask)  # estimator of d = -log rho: rho - 1 - log rho
    means = {"rollout/logprob_diff_mean": log_rho.abs(), "rollout_correction/is_ratio_mean": c.ratio,
             "rollout_correction/truncated_frac": c.truncated.float(), "rollout_correction/masked_frac":
             c.masked.float(), "rollout_correction/kl_k1": -log_rho, "rollout_correction/kl_k3": k3}
    if x.staleness is not None:
        means.update(_by_staleness(x.staleness, c.ratio, max_staleness))
        means["rollout/logprob_diff_mean_own"] = (x.staleness == 0).float() * log_rho.abs()
    sums = torch.stack([masked_sum(v.double(), mask) for v in means.values()] + [mask.double().sum()])
    *totals, count = all_reduce(sums).tolist()
    out = {k: t / max(count, 1.0) for k, t in zip(means, totals, strict=True)}
    peaks = {"rollout/logprob_diff_max": log_rho.abs(), "rollout_correction/is_ratio_max": c.ratio}
    if x.staleness is not None:
        peaks["async/staleness_tokens_max"] = x.staleness.float()
    local = torch.stack([torch.where(mask, v, 0).amax() if v.numel() else v.new_zeros(()) for v in peaks.values()])
    out.update(zip(peaks, all_reduce(local.double(), "max").tolist(), strict=True))
    for d in range(max_staleness + 1 if x.staleness is not None else 0):  # the mean over age-d tokens, not all
        weighted, share = out.pop(f"async/is_ratio_mean_{d}"), out[f"async/staleness_tokens_{d}"]
        if share > 0:
            out[f"async/is_ratio_mean_{d}"] = weighted / share
    if x.staleness is not None:  # a mean over the age-0 tokens (none: no value)
        own, share = out.pop("rollout/logprob_diff_mean_own"), out.get("async/staleness_tokens_0", 0.0)
        if share > 0:
            out["rollout/logprob_diff_mean_own"] = own / share
    return {k: v for k, v in out.items() if math.isfinite(v)}


def _by_staleness(staleness: torch.Tensor, ratio: torch.Tensor, max_staleness: int) -> dict[str, torch.Tensor]:
    """Per-token terms whose masked means are the staleness histogram, its mean, and (divided by the bin's share
    afterwards) the IS ratio mean per age."""
    out = {"async/staleness_tokens_mean": staleness.float()}
    for d in range(max_staleness + 1):
        age = (staleness == d).float()
        out[f"async/staleness_tokens_{d}"] = age
        out[f"async/is_ratio_mean_{d}"] = age * ratio
    return out


def distillation_metrics(batch: TrainBatch, old_logp: torch.Tensor) -> dict[str, float]:
    """`opd/reverse_kl`: KL(student || teacher) estimated on the student's samples (k1 per token), the mean over
    the whole batch's sequences (all ranks) of each sequence's token mean. Collective."""
    k = kl(old_logp, batch.teacher_logp, "k1", mask=batch.mask)
    nonempty = float((batch.mask.sum(-1) > 0).sum())
    row_mean_sum = float(aggregate(k, batch.mask, "seq-mean-token-mean", num_seqs=1.0))  # sum of the row means
    total, rows = all_reduce_sum([row_mean_sum, nonempty])
    return {"opd/reverse_kl": total / max(rows, 1.0)}


def kl_to_reference(batch: TrainBatch, old_logp: torch.Tensor, estimator: str) -> float:
    """Mean per-token KL of the pre-update policy to the reference over the whole batch. Collective."""
    k = kl(old_logp, batch.ref_logp, estimator, mask=batch.mask)
    total, count = all_reduce_sum([float(torch.where(batch.mask, k, 0).sum()), float(batch.mask.sum())])
    return total / max(count, 1.0)
