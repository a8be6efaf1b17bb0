"""``format.check``: the whole response must match the recipe's pattern (DOTALL)."""

import time

import pytest

from hybrid_rl.rewards.format import THINK_ANSWER_PATTERN, check, validate_pattern

CASES = [
    ("<think>2+2</think> <answer>4</answer>", 1.0),
    ("<think>line one\nline two</think>\n\n<answer>4\n</answer>", 1.0),
    ("<think></think><answer></answer>", 1.0),
    ("preamble <think>x</think><answer>4</answer>", 0.0),  # full match: nothing before
    ("<think>x</think><answer>4</answer> trailing", 0.0),  # ... and nothing after
    ("<think>x</think>", 0.0),
    ("<answer>4</answer>", 0.0),
    ("<answer>4</answer><think>x</think>", 0.0),
    ("<think>x<answer>4</answer>", 0.0),
    ("", 0.0),
]


@pytest.mark.parametrize(("response", "expected"), CASES)
def test_think_answer_format(response, expected):
    assert check(response, THINK_ANSWER_PATTERN) == expected


@pytest.mark.parametrize("response", [None, 42, b"<think>x</think><answer>4</answer>"])
def test_non_string_responses_score_zero(response):
    assert check(response, THINK_ANSWER_PATTERN) == 0.0


def test_dot_matches_newlines():
    assert check("a\nb", "a.b") == 1.0


def test_custom_pattern_is_matched_in_full():
    assert check("Answer: 42", r"Answer: \d+") == 1.0
    assert check("Answer: 42!", r"Answer: \d+") == 0.0


@pytest.mark.parametrize("pattern", ["(", "[a-", "*x", "(?P<n>a)(?P<n>b)"])
def test_bad_pattern_raises_a_clear_value_error(pattern):
    with pytest.raises(ValueError, match="invalid format pattern"):
        validate_pattern(pattern)
    with pytest.raises(ValueError, match="invalid format pattern"):
        check("anything", pattern)


def test_non_string_pattern_is_rejected():
    with pytest.raises(ValueError, match="must be a string"):
        validate_pattern(None)


def test_pattern_is_compiled_once():
    assert validate_pattern(r"<x>.*</x>") is validate_pattern(r"<x>.*</x>")


def test_long_response_is_checked_quickly():
    response = "<think>" + "</think> " * 3000 + "x" * 20_000
    start = time.monotonic()
    assert check(response, THINK_ANSWER_PATTERN) == 0.0
    assert time.monotonic() - start < 2.0
