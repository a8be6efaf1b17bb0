"""The `code` reward from the registry, scoring programs run in the sandbox."""

import pytest

from hybrid_rl.rewards.base import CodeReward, resolve_reward


@pytest.mark.sandbox
def test_code_reward_scores_the_fraction_of_tests_passed():
    reward = resolve_reward("code", timeout_s=2.0)
    assert isinstance(reward, CodeReward)
    tests = [{"input": "2\n", "output": "4"}, {"input": "3\n", "output": "6"}]
    assert reward("```python\nprint(int(input()) * 2)\n```", {"tests": tests}) == 1.0
    assert reward("```python\nprint(4)\n```", {"tests": tests}) == 0.5
