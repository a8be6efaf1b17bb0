"""Reward functions: the protocol, the built-in adapters, and resolution from a config string.

A reward is any callable ``fn(response, sample) -> float`` where ``sample`` is the dataset row
(``ground_truth`` for math, ``tests`` for code, ...). Built-ins are small frozen dataclasses so
they pickle by value into pool workers; a user function is named ``package.module:function``
and must be importable in those workers too.

>>> resolve_reward("math")("The answer is 4.", {"ground_truth": "4"})
1.0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hybrid_rl.rewards import code as code_reward
from hybrid_rl.rewards import format as format_reward
from hybrid_rl.rewards import math as math_reward
from hybrid_rl.rewards.names import import_object
from hybrid_rl.rewards.sandbox import SandboxConfig, check_isolation

__all__ = ["REWARDS", "CodeReward", "FormatReward", "MathReward", "RewardFn", "resolve_reward"]


@runtime_checkable
class RewardFn(Protocol):
    """Scores one finished response given its dataset row. Should not raise; the Rubric copes if it does."""

    def __call__(self, response: str, sample: Mapping[str, Any], /) -> float: ...


@dataclass(frozen=True)
class MathReward:
    """1.0 when the final answer equals ``sample[field]`` (see ``rewards.math``)."""

    field: str = "ground_truth"

    def __call__(self, response: str, sample: Mapping[str, Any], /) -> float:
        return math_reward.score(response, sample[self.field])

    def warmup(self) -> None:
        math_reward.warmup()


@dataclass(frozen=True)
class FormatReward:
    """1.0 when the whole response matches ``pattern`` (DOTALL); the pattern is checked at construction."""

    pattern: str = format_reward.THINK_ANSWER_PATTERN

    def __post_init__(self) -> None:
        format_reward.validate_pattern(self.pattern)

    def __call__(self, response: str, sample: Mapping[str, Any], /) -> float:
        return format_reward.check(response, self.pattern)


@dataclass(frozen=True)
class CodeReward:
    """Fraction of ``sample[field]`` tests the response's last Python block passes, in the sandbox.

    Construction checks that the sandbox level ``min_isolation`` is available here (fail at build time).
    One call may take ``len(tests) * timeout_s`` (plus ~40 ms per test): give a ``RewardPool`` /
    ``Rubric`` time limit above that.
    """

    field: str = "tests"
    timeout_s: float = 5.0
    memory_mb: int = 512
    min_isolation: str = "bwrap"

    def __post_init__(self) -> None:
        check_isolation(SandboxConfig(min_isolation=self.min_isolation))

    def __call__(self, response: str, sample: Mapping[str, Any], /) -> float:
        config = SandboxConfig(min_isolation=self.min_isolation)
        program = code_reward.extract_code(response) if isinstance(response, str) else ""
        result = code_reward.run(program, sample[self.field], self.timeout_s, self.memory_mb, config=config)
        return result.passed / result.total if result.total else 0.0


REWARDS: dict[str, Callable[..., RewardFn]] = {"math": MathReward, "format": FormatReward, "code": CodeReward}


def resolve_reward(name: str, **options: Any) -> RewardFn:
    """A built-in reward by name (``options`` go to its constructor), or a user one as ``pkg.module:attr``.

    For a user reward, ``options`` (if any) are passed to ``attr`` as a factory. Raises ValueError
    naming the known rewards, or the module / attribute that could not be loaded.
    """
    if name in REWARDS:
        return REWARDS[name](**options)
    if ":" not in name:
        raise ValueError(f"unknown reward {name!r}: known rewards are {sorted(REWARDS)}, or 'package.module:function'")
    target = import_object(name, "reward")
    reward = target(**options) if options else target
    if not callable(reward):
        raise ValueError(f"reward {name!r} is a {type(reward).__name__}, not a callable (response, sample) -> float")
    return reward
