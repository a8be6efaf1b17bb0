"""Rubric: a weighted sum of named rewards, with a per-name breakdown and failure accounting.

A reward that raises, returns a non-number, returns NaN/inf, or runs past the per-reward time
limit scores 0 for that sample and is recorded as a ``RewardFailure`` (index, name, message):
the batch always gets a finite score and never an exception.

>>> from hybrid_rl.rewards.base import resolve_reward
>>> rubric = Rubric([RubricItem("math", resolve_reward("math"), 1.0)])
>>> rubric.score(["#### 4"], [{"ground_truth": "4"}]).totals
[1.0]
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_rl.rewards._time_limit import time_limit
from hybrid_rl.rewards.base import RewardFn

__all__ = ["RewardFailure", "Rubric", "RubricItem", "SampleScore", "ScoreResult"]

_MAX_MESSAGE = 300


@dataclass(frozen=True)
class RubricItem:
    """One named reward and its weight in the total."""

    name: str
    fn: RewardFn
    weight: float = 1.0


@dataclass(frozen=True)
class RewardFailure:
    """Reward ``name`` failed on sample ``index``; ``kind`` is "error", "timeout" or "nonfinite"."""

    index: int
    name: str
    kind: str
    message: str


@dataclass(frozen=True)
class SampleScore:
    """The unweighted score of every reward on one sample (0.0 where it failed)."""

    index: int
    scores: dict[str, float]
    failures: tuple[RewardFailure, ...] = ()


@dataclass(frozen=True)
class ScoreResult:
    """Scores of a batch of N samples. ``by_name[name]`` is unweighted; ``totals`` is the weighted sum."""

    totals: list[float]  # [N]
    by_name: dict[str, list[float]]  # name -> [N]
    failures: list[RewardFailure]
    elapsed_s: float

    @property
    def num_errors(self) -> int:
        return sum(f.kind != "timeout" for f in self.failures)

    @property
    def num_timeouts(self) -> int:
        return sum(f.kind == "timeout" for f in self.failures)


class Rubric:
    """Weighted rewards. ``timeout_s`` bounds each reward call (None: no limit)."""

    def __init__(self, items: Sequence[RubricItem], *, timeout_s: float | None = None) -> None:
        names = [item.name for item in items]
        if not items or len(set(names)) != len(names):
            raise ValueError(f"a rubric needs at least one reward and unique names, got {names}")
        for item in items:
            if not callable(item.fn) or not math.isfinite(item.weight):
                raise ValueError(f"reward {item.name!r}: fn must be callable and weight finite")
        self.items = tuple(items)
        self.timeout_s = timeout_s

    @property
    def names(self) -> list[str]:
        return [item.name for item in self.items]

    def warmup(self) -> None:
        """Let each reward load what it needs up front (e.g. sympy), outside any time limit."""
        for item in self.items:
            warm = getattr(item.fn, "warmup", None)
            if callable(warm):
                warm()

    def score_sample(self, index: int, response: str, sample: Mapping[str, Any]) -> SampleScore:
        scores, failures = {}, []
        for item in self.items:
            value, failure = self._call(item, index, response, sample)
            scores[item.name] = value
            if failure is not None:
                failures.append(failure)
        return SampleScore(index, scores, tuple(failures))

    def _call(
        self, item: RubricItem, index: int, response: str, sample: Mapping[str, Any]
    ) -> tuple[float, RewardFailure | None]:
        limit = time_limit(self.timeout_s) if self.timeout_s else None
        raw: Any = None
        try:
            with limit if limit is not None else contextlib.nullcontext():
                raw = item.fn(response, sample)
        except Exception as err:
            return 0.0, RewardFailure(index, item.name, "error", f"{type(err).__name__}: {err}"[:_MAX_MESSAGE])
        if limit is not None and limit.expired:
            return 0.0, RewardFailure(index, item.name, "timeout", f"took longer than {self.timeout_s:g}s")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            return 0.0, RewardFailure(index, item.name, "error", f"returned {type(raw).__name__}, not a number")
        if not math.isfinite(value):
            return 0.0, RewardFailure(index, item.name, "nonfinite", f"returned {value}")
        return value, None

    def combine(self, samples: Sequence[SampleScore], elapsed_s: float) -> ScoreResult:
        """Batch result from per-sample scores (any order; indices say where each belongs)."""
        ordered = sorted(samples, key=lambda s: s.index)
        by_name = {name: [s.scores.get(name, 0.0) for s in ordered] for name in self.names}
        totals = [sum(item.weight * s.scores.get(item.name, 0.0) for item in self.items) for s in ordered]
        failures = [f for s in ordered for f in s.failures]
        return ScoreResult(totals, by_name, failures, elapsed_s)

    def score(self, responses: Sequence[str], samples: Sequence[Mapping[str, Any]]) -> ScoreResult:
        """Score a batch in this process, one sample after another."""
        if len(responses) != len(samples):
            raise ValueError(f"{len(responses)} responses but {len(samples)} samples")
        start = time.monotonic()
        scored = [self.score_sample(i, r, s) for i, (r, s) in enumerate(zip(responses, samples, strict=True))]
        return self.combine(scored, time.monotonic() - start)
