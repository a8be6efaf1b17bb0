"""Rollout correction: importance weights for the gap between the policy that sampled and the one that trains.

The tokens were sampled by the rollout engine (vLLM: bf16 kernels, its own sampler, in async runs
older weights); the update estimates the policy gradient as if the training model had sampled them.
This module turns that gap into a per-token weight on the policy-gradient loss.

Shapes: `B` sequences, `T` response tokens; `mask` is bool or float `[B, T]`, 1 on real response
tokens. Values under `mask == 0` are never read; every output is finite for finite input (and for
`-inf` log-probs), and 0 (or False) where `mask == 0`.

The ratio. Per token `t` of sequence `i`,
`rho_it = pi_old_train(y_it) / pi_rollout(y_it) = exp(old_logp_it - rollout_logp_it)`, with
`old_logp` the training model's log-probs before the update (the same numbers the PPO clip's
denominator uses; from the separate old-log-prob pass, or the update's own forward when it makes
one optimizer step) and `rollout_logp` the sampler's (`Sample.rollout_logprobs`). Each log-prob is
first clamped to `[-1e4, 1e4]` (`LOGP_BOUND`: `-inf`, an impossible token, reads as -1e4, so two
`-inf` agree with ratio 1 and sums never overflow). `level`:

- `token`: `rho_it = exp(clamp(old_logp_it - rollout_logp_it, -20, 20))`;
- `sequence`: one ratio per sequence, the product over its tokens computed in log space,
  `rho_i = exp(clamp(sum_t (old_logp_it - rollout_logp_it), -20, 20))`, given to each of its tokens.

`MAX_LOG_RATIO = 20` keeps `exp` finite in every float type (`e^20 ~ 4.85e8`); a row with an
empty mask has no tokens and no weight.

The modes (`CORRECTIONS`; `high`, `low` are the thresholds, `0 <= low <= 1 <= high`):

- `none`: weight 1 on every token (nothing is corrected; `ratio` is still computed, for metrics);
- `tis` (truncated IS): weight `min(rho, high)`; tokens with `rho > high` are *truncated*. `low`
  is not used (a small ratio only shrinks a token's weight; it cannot blow up the update);
- `mis` (masked IS): weight `rho` where `low <= rho <= high`, else 0: such tokens (token level)
  or whole sequences (sequence level) are *masked* out of the policy-gradient loss.

How it composes with the loss (`objectives.ppo_clip`): the weight is detached (no gradient flows
through it; it depends only on `old_logp` and `rollout_logp`, never on the weights being trained)
and multiplies the per-token PPO surrogate, dual clip included:
`l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))` with `r_t = pi_theta / pi_old_train`.
The PPO clip keeps bounding the trust region against `pi_old_train` and the correction reweights
each sampled token from the sampler's distribution to the old training policy's (the decoupled
PPO form of the TIS write-up). The KL-to-reference loss term and the entropy bonus are not
weighted: they are regularisers, not estimates of the return's gradient, and a masked token keeps
its regularisation.

Denominators: masked tokens (and masked sequences) still count in every aggregation's
denominator (`token-mean`'s token count, the `seq-mean-*` sequence count). MIS is an IS estimator
whose weight is 0 outside the band, and an IS mean divides by every sample drawn; dividing by the
kept tokens only would scale the others up by the share masked. It also keeps the update exact
under micro-batching: the denominators are counted over the whole mini-batch (all ranks) before
the first backward, when the old log-probs taken from the update's own forward do not exist yet.

Everything a token's weight depends on is in its own row, so computing it per micro-batch (as the
update does) or for the whole batch at once (as the metrics do) gives the same weights.
`CorrectionInputs` is where per-token inputs grow: `staleness`, how many policy versions before the
trained one sampled each token (asynchronous runs), feeds the staleness metrics (the histogram and
the IS ratio by age, `experience/batch.py`); the weights do not read it: the ratio already measures
the gap whatever its cause (staleness, kernels, a weight update in the middle of a response).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .registry import lookup

LOGP_BOUND = 1e4  # log-probs are read in [-1e4, 1e4]: -inf (an impossible token) becomes -1e4
MAX_LOG_RATIO = 20.0  # |log rho| cap: exp(20) ~ 4.85e8, finite in float32, bfloat16 and float16


@dataclass(frozen=True)
class CorrectionInputs:
    """`[B, T]` each; rows are sequences."""

    old_logp: Tensor  # the training model's log-probs before the update
    rollout_logp: Tensor  # the sampler's log-probs of the same tokens
    mask: Tensor  # 1 on real response tokens
    staleness: Tensor | None = None  # int64: policy versions between the token's sampler and the trained policy


@dataclass(frozen=True)
class CorrectionSettings:
    mode: str  # none | tis | mis
    level: str  # token | sequence
    low: float  # mis: ratios below are masked
    high: float  # tis: ratios above are truncated to it; mis: ratios above are masked

    @property
    def reweights(self) -> bool:
        """False for `none`: the loss is then computed exactly as without a correction (no multiply by 1)."""
        return self.mode != "none"


@dataclass(frozen=True)
class Correction:
    """Per token `[B, T]`, no gradient; 0 / False where `mask == 0`."""

    weight: Tensor  # float32: what the per-token policy-gradient loss is multiplied by
    ratio: Tensor  # float32: rho at the level (a sequence's on each of its tokens), before truncation or masking
    truncated: Tensor  # bool: tis cut rho down to `high`
    masked: Tensor  # bool: mis set the weight to 0


def token_log_ratio(x: CorrectionInputs) -> Tensor:
    """`old_logp - rollout_logp` per token `[B, T]` in float32, log-probs clamped to `+-LOGP_BOUND`, 0 off the mask."""
    keep = x.mask.bool()

    def read(logp: Tensor) -> Tensor:
        return torch.where(keep, logp.float(), 0).clamp(-LOGP_BOUND, LOGP_BOUND)

    return read(x.old_logp) - read(x.rollout_logp)


def _token_level(log_ratio: Tensor, keep: Tensor) -> Tensor:
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _sequence_level(log_ratio: Tensor, keep: Tensor) -> Tensor:
    per_row = log_ratio.sum(-1, keepdim=True).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [B, 1]: log of the product
    return torch.where(keep, per_row, 0)


LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"token": _token_level, "sequence": _sequence_level}


def _none(ratio: Tensor, keep: Tensor, s: CorrectionSettings) -> Correction:
    nothing = torch.zeros_like(keep)
    return Correction(keep.float(), ratio, nothing, nothing)


def _tis(ratio: Tensor, keep: Tensor, s: CorrectionSettings) -> Correction:
    truncated = keep & (ratio > s.high)
    return Correction(ratio.clamp(max=s.high), ratio, truncated, torch.zeros_like(keep))


def _mis(ratio: Tensor, keep: Tensor, s: CorrectionSettings) -> Correction:
    masked = keep & ((ratio < s.low) | (ratio > s.high))
    return Correction(torch.where(masked, 0, ratio), ratio, torch.zeros_like(keep), masked)


Mode = Callable[[Tensor, Tensor, CorrectionSettings], Correction]
CORRECTIONS: dict[str, Mode] = {"none": _none, "tis": _tis, "mis": _mis}


@torch.no_grad()
def rollout_correction(x: CorrectionInputs, s: CorrectionSettings) -> Correction:
    """The weights of `s.mode` at `s.level` (see the module docstring for the definitions)."""
    mode = lookup(CORRECTIONS, s.mode, kind="rollout correction")
    level = lookup(LEVELS, s.level, kind="rollout correction level")
    keep = x.mask.bool()
    ratio = torch.where(keep, torch.exp(level(token_log_ratio(x), keep)), 0)
    return mode(ratio, keep, s)
