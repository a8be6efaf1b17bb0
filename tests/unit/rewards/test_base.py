"""``base``: the reward protocol, built-in adapters and ``resolve_reward``."""

import pytest

from hybrid_rl.rewards import sandbox
from hybrid_rl.rewards.base import REWARDS, CodeReward, FormatReward, MathReward, RewardFn, resolve_reward
from hybrid_rl.rewards.sandbox import SandboxUnavailableError


def test_builtin_rewards_are_registered_by_name():
    assert set(REWARDS) == {"math", "format", "code"}


def test_math_reward_reads_the_ground_truth_field():
    reward = resolve_reward("math")
    assert isinstance(reward, MathReward) and isinstance(reward, RewardFn)
    assert reward(r"\boxed{\frac12}", {"ground_truth": "0.5"}) == 1.0
    assert resolve_reward("math", field="answer")("#### 3", {"answer": "3"}) == 1.0


def test_format_reward_takes_its_pattern_as_an_option():
    assert resolve_reward("format")("<think>a</think><answer>b</answer>", {}) == 1.0
    assert resolve_reward("format", pattern=r"\d+")("123", {}) == 1.0
    assert isinstance(resolve_reward("format"), FormatReward)


def test_bad_format_pattern_fails_at_construction():
    with pytest.raises(ValueError, match="invalid format pattern"):
        resolve_reward("format", pattern="(")


def test_code_reward_refuses_to_build_without_its_isolation_level(monkeypatch):
    monkeypatch.setattr(sandbox, "_probed", ("rlimits", "simulated"))
    with pytest.raises(SandboxUnavailableError):
        CodeReward()
    assert CodeReward(min_isolation="rlimits").min_isolation == "rlimits"


def test_unknown_name_lists_the_known_rewards():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*\['code', 'format', 'math'\]"):
        resolve_reward("nope")


def test_user_reward_by_dotted_path(user_rewards_module):
    reward = resolve_reward(f"{user_rewards_module}:length")
    assert reward("abcd", {}) == pytest.approx(0.4)


def test_user_reward_factory_gets_the_options(user_rewards_module):
    assert resolve_reward(f"{user_rewards_module}:make_constant", value=0.25)("x", {}) == 0.25


def test_missing_module_is_named_in_the_error():
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_hr'"):
        resolve_reward("no_such_module_hr:score")


def test_missing_attribute_is_named_in_the_error():
    with pytest.raises(ValueError, match="module 'json' has no attribute 'no_such_fn'"):
        resolve_reward("json:no_such_fn")


def test_non_callable_target_is_rejected():
    with pytest.raises(ValueError, match="not a callable"):
        resolve_reward("json.decoder:NaN")
