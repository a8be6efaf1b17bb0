"""Rule-based math reward: pull the final answer out of a response and compare it with the gold one.

Public contract (the rewards spec, ``rewards.md``): ``extract_answer``, ``is_equivalent``, ``score``.
None of them raises on model output, and each call is bounded in time: extraction is linear in the
text, and a comparison runs under a hard limit of ``TIME_LIMIT_S`` (answers longer than
``MAX_ANSWER_CHARS`` are only compared as plain strings). The first symbolic comparison in a
process also imports sympy (~1 s, outside the limit; ``warmup()`` does it up front).

>>> score(r"so the total is \\boxed{\\frac{3}{4}}", "0.75")
1.0
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

from hybrid_rl.rewards._math_compare import SympyNotLoaded, answers_equal, load_sympy
from hybrid_rl.rewards._math_text import normalize
from hybrid_rl.rewards._time_limit import time_limit

__all__ = ["MAX_ANSWER_CHARS", "TIME_LIMIT_S", "extract_answer", "is_equivalent", "score", "warmup"]

TIME_LIMIT_S = 1.0  # worst case of one is_equivalent call, plus ~1 ms of teardown
MAX_ANSWER_CHARS = 1_000  # real final answers are far shorter; longer ones get a plain string compare

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_HASHES = "####"
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is\s*:?|:)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"(?:(?<![\w)}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|(?<!\d)\.\d+")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
_TAG_RE = re.compile(r"</?[a-zA-Z_][\w-]*>")  # "#### 4</answer>": markup is not part of the answer


def extract_answer(text: str) -> str | None:
    """The final answer a response gives, by the first rule that finds one (see the spec):
    last ``\\boxed{}``/``\\fbox{}``, text after the last ``####``, after the last "answer is" /
    "Answer:", else the last number. None where nothing is found.

    >>> extract_answer(r"We get \\boxed{\\frac{1}{\\sqrt{2}}}.")
    '\\\\frac{1}{\\\\sqrt{2}}'
    """
    if not isinstance(text, str) or not text:
        return None
    for finder in (_last_boxed, _after_hashes, _after_answer_is, _last_number):
        found = finder(text)
        if found:
            return found
    return None


def _brace_partners(text: str) -> dict[int, int]:
    """Index of each ``{`` → index of its ``}``, in one linear pass (escaped braces skipped)."""
    partners, stack, i = {}, [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            partners[stack.pop()] = i
        i += 1
    return partners


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    partners = _brace_partners(text)
    for start in reversed(starts):
        rest = text[start:].lstrip()
        offset = len(text) - len(rest)
        if rest.startswith("{"):
            close = partners.get(offset)
            content = text[offset + 1 : close].strip() if close is not None else ""
        else:  # "\boxed 5": the argument runs to the next space or dollar
            content = re.split(r"[\s$]", rest, maxsplit=1)[0] if rest[:1] not in ("", "}") else ""
        if content:
            return content
    return None


def _after_hashes(text: str) -> str | None:
    index = text.rfind(_HASHES)
    if index < 0:
        return None
    lines = [line.strip() for line in _TAG_RE.sub(" ", text[index + len(_HASHES) :]).splitlines() if line.strip()]
    return lines[0] if lines else None


def _after_answer_is(text: str) -> str | None:
    last = None
    for last in _ANSWER_IS_RE.finditer(text):  # noqa: B007 - only the last match counts
        pass
    if last is None:
        return None
    lines = [line.strip(" \t*:") for line in _TAG_RE.sub(" ", text[last.end() :]).splitlines()]
    tail = next((line for line in lines if line), "")
    return _first_math_or_sentence(tail) or None


def _first_math_or_sentence(tail: str) -> str:
    """``$\\frac12$. I hope it is correct.`` → ``\\frac12``; ``42. Done`` → ``42``."""
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if tail.startswith(left):
            end = tail.find(right, len(left))
            return tail[len(left) : end if end >= 0 else len(tail)].strip()
    end = _SENTENCE_END_RE.search(tail)
    return tail[: end.start() if end else len(tail)].strip().rstrip(".").strip()


def _last_number(text: str) -> str | None:
    last = None
    for last in _NUMBER_RE.finditer(text):  # noqa: B007 - only the last match counts
        pass
    return last.group() if last else None


def _as_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float | Fraction | Decimal) and not isinstance(value, bool):
        return str(value)
    return None


def is_equivalent(pred: str, gold: str) -> bool:
    """True when the two answers are mathematically the same. Never raises; False after ``TIME_LIMIT_S``.

    Choices (the graders disagree on some; these are ours):
    - exact numbers compare exactly; once a side is a written decimal, within 1e-6 relative
      (``0.3333333`` equals ``\\frac13``, ``0.33`` does not; ``3.14`` is not ``\\pi``);
    - a percentage on one side may be read as the number or as the number / 100: ``50\\%``
      equals ``50`` and ``0.5`` (``5000`` never equals ``50``);
    - ``3\\frac{1}{2}`` is a mixed number (3.5); ``x = 3`` equals ``3``; units, ``\\text{}``,
      ``$`` and degree signs are dropped; ``(A)`` equals ``A``;
    - tuples and intervals compare element-wise and their brackets must agree; a set gold (or a
      bare comma list) matches in any order; ``x > 3`` equals ``(3, \\infty)``;
    - expressions with variables must agree at fixed points (positive values, so ``\\sqrt{x^2}``
      equals ``x``); text answers compare case-insensitively.

    >>> is_equivalent(r"\\dfrac{\\sqrt2}{2}", r"\\frac{1}{\\sqrt{2}}")
    True
    """
    pred_text, gold_text = _as_text(pred), _as_text(gold)
    if pred_text is None or gold_text is None or not pred_text.strip() or not gold_text.strip():
        return False
    if len(pred_text) > MAX_ANSWER_CHARS or len(gold_text) > MAX_ANSWER_CHARS:
        return pred_text.strip() == gold_text.strip()
    try:
        return _compare_within_limit(pred_text, gold_text)
    except SympyNotLoaded:  # first symbolic answer in this process: import outside the time limit
        load_sympy()
        return _compare_within_limit(pred_text, gold_text)


def _compare_within_limit(pred: str, gold: str) -> bool:
    result = False
    with time_limit(TIME_LIMIT_S) as limit:
        try:
            pred_norm, gold_norm = normalize(pred), normalize(gold)
            result = bool(pred_norm and gold_norm) and answers_equal(pred_norm, gold_norm)
        except SympyNotLoaded:
            raise
        except Exception:  # odd input in a library corner: not equivalent
            result = False
    return result and not limit.expired


def warmup() -> None:
    """Import sympy now (~1 s) rather than at the first symbolic answer, e.g. when a worker starts."""
    load_sympy()


def score(response: str, ground_truth: str) -> float:
    """1.0 when the response's final answer is equivalent to ``ground_truth``, else 0.0.

    >>> score("#### 1,000", "1000")
    1.0
    """
    try:
        answer = extract_answer(response)
        return 1.0 if answer is not None and is_equivalent(answer, ground_truth) else 0.0
    except Exception:  # the contract: a reward never raises on model output
        return 0.0
