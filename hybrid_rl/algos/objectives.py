"""Training objectives: what one micro-batch's loss is, given the model's fresh log-probs.

An objective is a pure function of tensors; the trainer runs the model and passes the global
denominators (whole mini-batch, all ranks) so micro-batching never changes the result. Adding an
objective is one function plus one line in `OBJECTIVES`, saying whether it trains on preference
pairs (then a pair is one unit for packing, micro-batching and rank balancing).

`ppo_clip`, `gspo` and `cispo` are policy-gradient objectives: one body (`_policy_gradient`) around their per-token
surrogates (`surrogates.py`), so rollout correction, the KL loss term, the entropy bonus and the global
denominators work the same for all three. GSPO's sequence ratio is a row's mean: a micro-batch holds whole
samples, one per row (`model/forward.py`), so every row is a whole sequence however the mini-batch is cut.

Rollout correction (`correction.py`) reweights a policy-gradient objective's per-token surrogate. It is refused for
the DPO objective (a config error): DPO's loss is a function of whole (chosen, rejected) pairs under
the training model and the reference, not a policy-gradient estimate over sampled tokens, so there
is no sampler's distribution to correct for (and offline pairs have no rollout log-probs at all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .correction import CorrectionInputs, CorrectionSettings, rollout_correction
from .losses import aggregate, dpo_loss, kl
from .masked import masked_sum
from .registry import lookup
from .surrogates import Surrogate, cispo_surrogate, clipped_surrogate, gspo_surrogate


@dataclass(frozen=True)
class ObjectiveSettings:
    loss_agg: str
    clip_low: float | None  # None: no lower bound (cispo only)
    clip_high: float
    dual_clip: float | None
    kl_coef: float  # KL as a loss term (0 when the KL penalty is in the reward)
    kl_estimator: str
    entropy_coef: float
    dpo_beta: float
    dpo_kind: str
    dpo_label_smoothing: float
    correction: CorrectionSettings | None = None  # rollout correction of the policy gradient (None: off, as `none`)


@dataclass(frozen=True)
class Denominators:
    """Counts of a whole mini-batch over every micro-batch and rank: what each micro-batch's loss divides by."""

    num_tokens: float
    num_seqs: float
    num_pairs: float
    horizon: float  # the max response length: Dr. GRPO's constant denominator

    def aggregate_kwargs(self) -> dict[str, float]:
        return {"num_tokens": self.num_tokens, "num_seqs": self.num_seqs, "horizon": self.horizon}


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
    rollout_logp: Tensor | None = None  # the sampler's log-probs (None: offline pairs)


StatSums = dict[str, tuple[Tensor, Tensor]]  # name -> (sum, count) of one micro-batch, 0-d tensors


def _token_stat(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return masked_sum(values.detach().float(), mask), mask.float().sum()


def ppo_clip(x: MicroInputs, s: ObjectiveSettings, d: Denominators) -> tuple[Tensor, StatSums]:
    """PPO clipped surrogate (+ KL to the reference as a loss term, - entropy bonus); see `_policy_gradient`."""
    t = clipped_surrogate(x.logp, x.old_logp, x.advantages, x.mask, s.clip_low, s.clip_high, s.dual_clip)
    return _policy_gradient(t, x, s, d)


def gspo(x: MicroInputs, s: ObjectiveSettings, d: Denominators) -> tuple[Tensor, StatSums]:
    """GSPO-token (`losses.gspo_loss`): the sequence ratio, each row's mean log-ratio, on every token of the row."""
    t = gspo_surrogate(x.logp, x.old_logp, x.advantages, x.mask, s.clip_low, s.clip_high)
    return _policy_gradient(t, x, s, d)


def cispo(x: MicroInputs, s: ObjectiveSettings, d: Denominators) -> tuple[Tensor, StatSums]:
    """CISPO (`losses.cispo_loss`): REINFORCE weighted by the clipped, detached importance ratio."""
    t = cispo_surrogate(x.logp, x.old_logp, x.advantages, x.mask, s.clip_low, s.clip_high)
    return _policy_gradient(t, x, s, d)


def _policy_gradient(t: Surrogate, x: MicroInputs, s: ObjectiveSettings, d: Denominators) -> tuple[Tensor, StatSums]:
    """A per-token surrogate's loss (+ KL to the reference as a loss term, - entropy bonus).

    The loss uses the mini-batch's global denominators. With `s.correction`, each token's surrogate
    is multiplied by its rollout-correction weight (detached; `correction.py`), the denominators
    unchanged. Stats are (sum, count) over this micro-batch's tokens, so that the trainer reports
    exact token means over all micro-batches and ranks with one reduction at the end (no host sync
    per micro-batch).
    """
    denoms = d.aggregate_kwargs()
    pg = t.per_token
    if s.correction is not None and s.correction.reweights:
        assert x.rollout_logp is not None, "rollout correction needs the sampler's log-probs"
        c = rollout_correction(CorrectionInputs(x.old_logp, x.rollout_logp, x.mask), s.correction)
        pg = pg * c.weight.to(pg.dtype)
    loss = aggregate(pg, x.mask, s.loss_agg, **denoms)
    count = x.mask.float().sum()
    stats = {k: (v * count, count) for k, v in t.stats(x.mask).items()}
    stats["pg_loss"] = _token_stat(pg, x.mask)
    if x.ref_logp is not None:
        k = kl(x.logp, x.ref_logp, s.kl_estimator, mask=x.mask)
        stats["kl"] = _token_stat(k, x.mask)
        if s.kl_coef:
            loss = loss + s.kl_coef * aggregate(k, x.mask, s.loss_agg, **denoms)
    if x.entropy is not None:
        stats["entropy"] = _token_stat(x.entropy, x.mask)
        if s.entropy_coef:
            loss = loss - s.entropy_coef * aggregate(x.entropy, x.mask, s.loss_agg, **denoms)
    return loss, stats


def dpo(x: MicroInputs, s: ObjectiveSettings, d: Denominators) -> tuple[Tensor, StatSums]:
    """DPO on (chosen, rejected) pairs of this micro-batch; mean over all pairs of the mini-batch."""
    m = x.mask.to(x.logp.dtype)
    seq = (x.logp * m).sum(-1)
    ref = (x.ref_logp * m).sum(-1)
    c, r = x.pairs[:, 0], x.pairs[:, 1]
    losses, chosen_r, rejected_r = dpo_loss(seq[c], seq[r], ref[c], ref[r], s.dpo_beta, s.dpo_kind,
                                            s.dpo_label_smoothing)
    loss = losses.sum() / d.num_pairs
    n = torch.tensor(float(len(c)))
    stats = {"dpo_loss": (losses.detach().sum(), n), "reward_margin": ((chosen_r - rejected_r).sum(), n),
             "reward_accuracy": ((chosen_r > rejected_r).float().sum(), n)}
    return loss, stats


LossFn = Callable[[MicroInputs, ObjectiveSettings, Denominators], tuple[Tensor, StatSums]]


@dataclass(frozen=True)
class Objective:
    loss: LossFn
    paired: bool  # trains on (chosen, rejected) pairs, adjacent rows; else on single samples with advantages
    entropy: bool  # reports (and may train) the policy's token entropy
    policy_gradient: bool = True  # a per-token surrogate over sampled tokens: rollout correction can reweight it
    unbounded_low: bool = False  # accepts clip_low=None (no lower bound on the ratio)
    dual_clip: bool = False  # applies `dual_clip` (PPO's bound on a negative advantage's huge ratio)


OBJECTIVES: dict[str, Objective] = {
    "ppo_clip": Objective(ppo_clip, paired=False, entropy=True, dual_clip=True),
    "gspo": Objective(gspo, paired=False, entropy=True),
    "cispo": Objective(cispo, paired=False, entropy=True, unbounded_low=True),
    "dpo": Objective(dpo, paired=True, entropy=False, policy_gradient=False),
}


def get_objective(name: str) -> Objective:
    return lookup(OBJECTIVES, name, kind="objective")


def zero_like_loss(logp: Tensor) -> Tensor:
    """A zero loss connected to the graph (a rank with nothing to train must still join FSDP's backward)."""
    return (logp * 0).sum() if logp.numel() else torch.zeros((), requires_grad=True)
