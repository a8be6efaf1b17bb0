"""One adapter per advantage estimator: what it reads and how it is called, for a batch split over ranks.

The contract functions in `advantages.py` take a whole batch. The trainer holds only its share of
the token-level tensors (`[B, T]`), but every sample's outcome score (`[N]`) and group: group
estimators (GRPO, RLOO) run on the whole `[N]` vector and keep their rows; token estimators (GAE,
REINFORCE++) run row by row on the share and whiten with moments of the whole batch through
`reduce` (an all-reduce sum, passed in: nothing here knows about processes). With one share holding
the whole batch and `reduce` the identity, each adapter returns exactly what its contract function
returns.

Episodes (`episodes`, a black-box agent's episode stitched into several samples): group estimators run on one row
per episode (its last sample's score and group) and give each of its samples the episode's advantage, so group means
and standard deviations count episodes, not pieces (SkyRL's step-wise training does the same: the advantage of the
last step, broadcast to the trajectory's steps). Token estimators are per row already: each sample gets its outcome
score (the episode's) at its last token.

Adding an estimator: its function in `advantages.py`, one adapter here, one line in `ESTIMATORS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .advantages import discounted_returns, gae_unwhitened, grpo, rloo
from .groups import episode_rows
from .masked import masked_whiten
from .registry import lookup
from .shaping import token_rewards


@dataclass(frozen=True)
class AdvantageInputs:
    """Shapes: `N` samples of the step, `B` rows of this share, `T` its response width."""

    scores: Tensor  # [N] outcome score of every sample of the step
    groups: Tensor  # [N] group id of every sample
    rows: Tensor  # [B] long: this share's samples, as indices into N
    mask: Tensor  # [B, T] response tokens of the share
    values: Tensor | None = None  # [B, T] critic values (GAE)
    kl: Tensor | None = None  # [B, T] per-token KL to the reference, when it is part of the reward
    kl_coef: float = 0.0
    reduce: Callable[[Tensor], Tensor] | None = None  # sum over ranks (None: the share is the whole batch)
    episodes: Tensor | None = None  # [N] episode id of every sample (None: each sample is an episode of its own)


@dataclass(frozen=True)
class AdvantageSettings:
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True


Result = tuple[Tensor, Tensor | None]  # (advantages [B, T], returns [B, T] or None)


def _per_sample(advantage_of_all: Tensor, x: AdvantageInputs) -> Tensor:
    return advantage_of_all[x.rows] * x.mask


def _by_episode(estimate: Callable[[Tensor, Tensor, Tensor], Tensor], x: AdvantageInputs) -> Tensor:
    """`[N, 1]`: a group estimator (scores, groups, mask) run on one row per episode, each sample given its episode's."""
    if x.episodes is None:
        return estimate(x.scores, x.groups, torch.ones(x.scores.shape[0], 1))
    last, inverse = episode_rows(x.episodes)
    return estimate(x.scores[last], x.groups[last], torch.ones(last.shape[0], 1))[inverse]


def _grpo(x: AdvantageInputs, s: AdvantageSettings) -> Result:
    return _per_sample(_by_episode(lambda sc, g, m: grpo(sc, g, m, norm_by_std=s.norm_by_std), x), x), None


def _rloo(x: AdvantageInputs, s: AdvantageSettings) -> Result:
    return _per_sample(_by_episode(rloo, x), x), None


def _token_rewards(x: AdvantageInputs) -> Tensor:
    return token_rewards(x.scores[x.rows], x.mask, x.kl, x.kl_coef)


def _gae(x: AdvantageInputs, s: AdvantageSettings) -> Result:
    assert x.values is not None, "GAE needs the critic's values"
    adv, returns = gae_unwhitened(_token_rewards(x), x.values, x.mask, s.gamma, s.lam)
    return masked_whiten(adv, x.mask, reduce=x.reduce), returns


def _reinforce_pp(x: AdvantageInputs, s: AdvantageSettings) -> Result:
    returns = discounted_returns(_token_rewards(x), x.mask, s.gamma)
    return masked_whiten(returns, x.mask, reduce=x.reduce), returns


Estimator = Callable[[AdvantageInputs, AdvantageSettings], Result]
ESTIMATORS: dict[str, Estimator] = {"grpo": _grpo, "rloo": _rloo, "gae": _gae, "reinforce_pp": _reinforce_pp}


def get_estimator(name: str) -> Estimator:
    return lookup(ESTIMATORS, name, kind="advantage estimator")
