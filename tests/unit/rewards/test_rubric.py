"""``Rubric``: weighted totals, per-name breakdown, and failures that never escape."""

import math

import pytest

from hybrid_rl.rewards.base import resolve_reward
from hybrid_rl.rewards.rubric import RewardFailure, Rubric, RubricItem


def _rubric(user_rewards_module, *names, timeout_s=None):
    items = [RubricItem("math", resolve_reward("math"), 1.0), RubricItem("format", resolve_reward("format"), 0.5)]
    items += [RubricItem(n, resolve_reward(f"{user_rewards_module}:{n}"), 2.0) for n in names]
    return Rubric(items, timeout_s=timeout_s)


RESPONSES = ["<think>x</think><answer>#### 4</answer>", "#### 5"]
SAMPLES = [{"ground_truth": "4"}, {"ground_truth": "4"}]


def test_total_is_the_weighted_sum_and_breakdown_is_unweighted(user_rewards_module):
    result = _rubric(user_rewards_module).score(RESPONSES, SAMPLES)
    assert result.by_name == {"math": [1.0, 0.0], "format": [1.0, 0.0]}
    assert result.totals == [1.5, 0.0]
    assert result.failures == [] and result.num_errors == 0 and result.elapsed_s >= 0


def test_raising_reward_scores_zero_and_is_reported_with_index_and_message(user_rewards_module):
    result = _rubric(user_rewards_module, "boom").score(RESPONSES, SAMPLES)
    assert result.by_name["boom"] == [0.0, 0.0]
    assert result.totals == [1.5, 0.0]  # the other rewards still count
    assert result.failures[1] == RewardFailure(1, "boom", "error", "RuntimeError: boom on '#### 5'")
    assert result.num_errors == 2 and result.num_timeouts == 0


@pytest.mark.parametrize("name", ["nan", "infinite"])
def test_non_finite_reward_is_an_error_and_never_passed_on(user_rewards_module, name):
    result = _rubric(user_rewards_module, name).score(RESPONSES, SAMPLES)
    assert all(math.isfinite(t) for t in result.totals)
    assert result.by_name[name] == [0.0, 0.0]
    assert [f.kind for f in result.failures] == ["nonfinite", "nonfinite"] and result.num_errors == 2


def test_non_number_reward_is_an_error(user_rewards_module):
    result = _rubric(user_rewards_module, "not_a_number").score(RESPONSES[:1], SAMPLES[:1])
    assert result.failures[0].kind == "error" and "not a number" in result.failures[0].message


def test_missing_sample_field_is_an_error_not_an_exception():
    result = Rubric([RubricItem("math", resolve_reward("math"))]).score(["#### 4"], [{}])
    assert result.totals == [0.0] and result.failures[0].message.startswith("KeyError")


def test_slow_reward_times_out(user_rewards_module):
    rubric = _rubric(user_rewards_module, "sleep_forever", timeout_s=0.3)
    result = rubric.score(RESPONSES[:1], SAMPLES[:1])
    assert result.num_timeouts == 1 and result.failures[0].name == "sleep_forever"
    assert result.totals == [1.5]


def test_rubric_needs_unique_names_and_at_least_one_reward():
    fn = resolve_reward("math")
    with pytest.raises(ValueError, match="unique"):
        Rubric([RubricItem("a", fn), RubricItem("a", fn)])
    with pytest.raises(ValueError, match="at least one"):
        Rubric([])


def test_non_finite_weight_is_rejected():
    with pytest.raises(ValueError, match="weight finite"):
        Rubric([RubricItem("a", resolve_reward("math"), math.nan)])


def test_mismatched_batch_is_rejected():
    with pytest.raises(ValueError, match="2 responses but 1 samples"):
        Rubric([RubricItem("math", resolve_reward("math"))]).score(["a", "b"], [{}])
