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

`ADVANTAGES` is the one registry: `ESTIMATORS` holds an adapter for each of its functions, chosen by what the
function reads first (outcome `scores` by `group_ids`, or token `rewards`) and called with the inputs and settings
its parameters name (`values`, `gamma`, `lam`, `norm_by_std`, `reduce`). Adding an estimator: its function in
`advantages.py` and one line in `ADVANTAGES`; nothing here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .advantages import ADVANTAGES
from .groups import episode_rows
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
    turn_rewards: Tensor | None = None  # [B, T] multi-turn step rewards on their turns' last tokens (token estimators)


@dataclass(frozen=True)
class AdvantageSettings:
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True


Result = tuple[Tensor, Tensor | None]  # (advantages [B, T], returns [B, T] or None)
Estimator = Callable[[AdvantageInputs, AdvantageSettings], Result]


def _call(fn: Callable[..., Any], available: dict[str, Any]) -> Any:
    """`fn` called with those of `available` it names as parameters (its defaults for the rest)."""
    params = inspect.signature(fn).parameters
    return fn(**{name: value for name, value in available.items() if name in params})


def _group_estimator(fn: Callable[..., Tensor]) -> Estimator:
    """An estimator of outcome scores by group (`fn(scores, group_ids, mask, ...)`): run on the whole `[N]` vector, one
    row per episode, each of this share's samples given its episode's advantage."""

    def estimate(x: AdvantageInputs, s: AdvantageSettings) -> Result:
        scores, groups, inverse = x.scores, x.groups, None
        if x.episodes is not None:
            last, inverse = episode_rows(x.episodes)
            scores, groups = scores[last], groups[last]
        per_row = _call(fn, {"scores": scores, "group_ids": groups, "mask": torch.ones(scores.shape[0], 1),
                             "norm_by_std": s.norm_by_std})  # [episodes, 1]
        per_sample = per_row if inverse is None else per_row[inverse]
        return per_sample[x.rows] * x.mask, None

    return estimate


def _token_estimator(fn: Callable[..., tuple[Tensor, Tensor]]) -> Estimator:
    """An estimator of token rewards (`fn(rewards, [values,] mask, gamma, ..., reduce)`): run on this share's rows,
    whitened with moments of the whole batch through `reduce`."""

    def estimate(x: AdvantageInputs, s: AdvantageSettings) -> Result:
        rewards = token_rewards(x.scores[x.rows], x.mask, x.kl, x.kl_coef, x.turn_rewards)
        if "values" in inspect.signature(fn).parameters:
            assert x.values is not None, "this advantage estimator needs the critic's values"
        return _call(fn, {"rewards": rewards, "values": x.values, "mask": x.mask, "gamma": s.gamma, "lam": s.lam,
                          "reduce": x.reduce})

    return estimate


def _adapter(fn: Callable[..., Any]) -> Estimator:
    """The adapter of an `ADVANTAGES` function, by what it reads first: outcome `scores` or token `rewards`."""
    first = next(iter(inspect.signature(fn).parameters))
    if first == "scores":
        return _group_estimator(fn)
    if first == "rewards":
        return _token_estimator(fn)
    raise TypeError(f"advantage estimator {fn.__name__} reads {first!r}: expected 'scores' or 'rewards'")


ESTIMATORS: dict[str, Estimator] = {name: _adapter(fn) for name, fn in ADVANTAGES.items()}


def get_estimator(name: str) -> Estimator:
    return lookup(ESTIMATORS, name, kind="advantage estimator")
