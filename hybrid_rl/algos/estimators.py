"""One adapter per advantage estimator: what it reads and how it is called, for a batch split over ranks.

The contract functions in `advantages.py` take a whole batch. The trainer holds only its share of
the token-level tensors (`[B, T]`), but every sample's outcome score (`[N]`) and group: group
estimators (GRPO, RLOO) run on the whole `[N]` vector and keep their rows; token estimators (GAE,
REINFORCE++) run row by row on the share and whiten with moments of the whole batch through
`reduce` (an all-reduce sum, passed in: nothing here knows about processes). With one share holding
the whole batch and `reduce` the identity, each adapter returns exactly what its contract function
returns.

Adding an estimator: its function in `advantages.py`, one adapter here, one line in `ESTIMATORS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .advantages import discounted_returns, gae_unwhitened, grpo, rloo
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


@dataclass(frozen=True)
class AdvantageSettings:
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True


Result = tuple[Tensor, Tensor | None]  # (advantages [B, T], returns [B, T] or None)


def _per_sample(advantage_of_all: Tensor, x: AdvantageInputs) -> Tensor:
    return advantage_of_all[x.rows] * x.mask


def _grpo(x: AdvantageInputs, s: AdvantageSettings) -> Result:
    ones = torch.ones(x.scores.shape[0], 1)
    return _per_sample(grpo(x.scores, x.groups, ones, norm_by_std=s.norm_by_std), x), None


def _rloo(x: AdvantageInputs, s: AdvantageSettings) -> Result:
    return _per_sample(rloo(x.scores, x.groups, torch.ones(x.scores.shape[0], 1)), x), None


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
