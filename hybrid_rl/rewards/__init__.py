"""Rule-based rewards: scorers that need no model (math answers, response format, code tests).

Layer 1 of hybrid_rl: imports nothing else from hybrid_rl, and never torch, vLLM or Hydra.
The function contracts are in the rewards spec (``rewards.md``); ``math``, ``format`` and ``code`` hold the
scorers, ``sandbox`` the code executor, ``base`` the reward protocol and registry, ``rubric`` the
weighted combination, and ``pool`` scoring in worker processes.
"""

from hybrid_rl.rewards.base import REWARDS, CodeReward, FormatReward, MathReward, RewardFn, resolve_reward
from hybrid_rl.rewards.pool import RewardPool, ScoringHandle
from hybrid_rl.rewards.rubric import RewardFailure, Rubric, RubricItem, SampleScore, ScoreResult

__all__ = [
    "REWARDS",
    "CodeReward",
    "FormatReward",
    "MathReward",
    "RewardFailure",
    "RewardFn",
    "RewardPool",
    "Rubric",
    "RubricItem",
    "SampleScore",
    "ScoreResult",
    "ScoringHandle",
    "resolve_reward",
]
