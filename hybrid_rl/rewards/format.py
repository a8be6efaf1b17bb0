"""Format reward: does the whole response follow the recipe's template (a regular expression)?

>>> check("<think>2+2</think> <answer>4</answer>", THINK_ANSWER_PATTERN)
1.0
"""

from __future__ import annotations

import functools
import re

__all__ = ["THINK_ANSWER_PATTERN", "check", "validate_pattern"]

THINK_ANSWER_PATTERN = r"<think>.*</think>\s*<answer>.*</answer>"


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.DOTALL)


def validate_pattern(pattern: str) -> re.Pattern[str]:
    """Compile ``pattern`` (DOTALL) or raise a ValueError that says what is wrong: call it at config time."""
    if not isinstance(pattern, str):
        raise ValueError(f"format pattern must be a string, got {type(pattern).__name__}")
    try:
        return _compiled(pattern)
    except re.error as err:
        raise ValueError(
            f"invalid format pattern {pattern!r}: {err} (Python `re` syntax, matched with DOTALL)"
        ) from err


def check(response: str, pattern: str) -> float:
    """1.0 when ``pattern`` matches the entire response (``re.fullmatch``, DOTALL), else 0.0.

    A bad pattern raises ValueError (a config error, not the model's); odd responses score 0.0.
    """
    compiled = validate_pattern(pattern)
    if not isinstance(response, str):
        return 0.0
    return 1.0 if compiled.fullmatch(response) else 0.0
