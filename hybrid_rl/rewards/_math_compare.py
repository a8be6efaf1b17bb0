"""Compare two normalised answers: first their shape (set, interval/tuple, matrix, ...), then values.

Value rules (documented in ``math.is_equivalent``):
- exact numbers compare exactly (``2^{100}`` is not ``2^{100}+1``);
- as soon as one side is a written decimal, relative tolerance 1e-6 (``0.3333333`` equals ``\\frac13``,
  ``0.33`` does not);
- a percentage on one side only also matches that value / 100 (``50\\%`` equals ``50`` and ``0.5``);
- expressions with variables are compared at fixed pseudo-random points (a sympy ``simplify``
  decides only where the points cannot be evaluated).
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from hybrid_rl.rewards._math_shape import Shape, shape_of, split_top
from hybrid_rl.rewards._math_text import compact

__all__ = ["REL_TOL_DECIMAL", "SympyNotLoaded", "answers_equal", "load_sympy"]

REL_TOL_DECIMAL = 1e-6  # one side written as a decimal: "0.3333333" equals 1/3, "0.33" does not
_SYMPY_MODULE = "hybrid_rl.rewards._math_sympy"
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?")
_MAX_FAST_EXPONENT = 300  # Fraction("1e999999999") would build that integer; sympy's Float does not
_INT_FRACTION_RE = re.compile(r"([+-]?)(?:(\d+)\s*/\s*(\d+)|\\frac\{(\d+)\}\{(\d+)\})")
_NUMBER_THEN_WORDS_RE = re.compile(r"([+-]?[\d.]+)\s+[a-zA-Z][a-zA-Z ]*")


class SympyNotLoaded(Exception):  # noqa: N818 - a signal to the caller, not an error
    """Raised where sympy is needed but not imported yet: the caller imports it outside its time limit
    (an import cut short by a time limit would leave half-initialised modules behind)."""


def load_sympy() -> None:
    """Import sympy and the parser (~1 s, once per process)."""
    importlib.import_module(_SYMPY_MODULE)


def _sympy() -> Any:
    module = sys.modules.get(_SYMPY_MODULE)
    if module is None:
        raise SympyNotLoaded
    return module


@dataclass(frozen=True)
class _Num:
    """A plain number, read without sympy: the fast path for most grade-school answers."""

    value: Fraction
    exact: bool


def answers_equal(pred: str, gold: str) -> bool:
    """Whether two normalised answers are the same: shapes first, then element values."""
    if compact(pred) == compact(gold):
        return True
    return _shapes_equal(shape_of(pred), shape_of(gold))


def _shapes_equal(pred: Shape, gold: Shape) -> bool:
    if gold.kind in ("set", "list"):
        items = pred.items if pred.kind in ("set", "list", "scalar") else None
        return items is not None and _unordered_equal(list(items), list(gold.items), scalar=True)
    if gold.kind == "union":
        return pred.kind == "union" and _unordered_equal(list(pred.items), list(gold.items), scalar=False)
    if gold.kind in ("tuple", "matrix"):
        same = pred.kind == gold.kind and pred.brackets == gold.brackets and len(pred.items) == len(gold.items)
        return same and all(_item_equal(p, g) for p, g in zip(pred.items, gold.items, strict=True))
    if pred.kind in ("set", "list") and len(pred.items) == 1:
        return scalar_equal(pred.items[0], gold.items[0])
    return pred.kind == "scalar" and scalar_equal(pred.items[0], gold.items[0])


def _item_equal(pred: Any, gold: Any) -> bool:
    if isinstance(gold, Shape):
        return isinstance(pred, Shape) and _shapes_equal(pred, gold)
    if isinstance(gold, tuple):  # a matrix row
        same_len = isinstance(pred, tuple) and len(pred) == len(gold)
        return same_len and all(answers_equal(p, g) for p, g in zip(pred, gold, strict=True))
    return isinstance(pred, str) and answers_equal(pred, gold)


def _unordered_equal(pred: list[Any], gold: list[Any], *, scalar: bool) -> bool:
    """Multiset equality under the element comparison (greedy matching; answers are short)."""
    if len(pred) != len(gold):
        return False
    remaining = list(gold)
    for p in pred:
        match = next(
            (i for i, g in enumerate(remaining) if (answers_equal(p, g) if scalar else _item_equal(p, g))), None
        )
        if match is None:
            return False
        remaining.pop(match)
    return True


def scalar_equal(pred: str, gold: str) -> bool:
    """Two single answers (no top-level commas): equations, percentages, numbers, expressions, text."""
    if compact(pred) == compact(gold):
        return True
    if "=" in pred or "=" in gold:
        return _equations_equal(pred, gold)
    (pred, pred_pct), (gold, gold_pct) = _split_percent(pred), _split_percent(gold)
    pred_value, gold_value = _value(pred), _value(gold)
    if pred_value is None and gold_value is not None:
        words = _NUMBER_THEN_WORDS_RE.fullmatch(pred)  # "5 apples" against "5"
        pred_value = _value(words.group(1)) if words else None
    if pred_value is None or gold_value is None:
        return pred_value is None and gold_value is None and compact(pred).lower() == compact(gold).lower()
    scales = [(1, 1)]
    if pred_pct != gold_pct:
        scales.append((100, 1) if pred_pct else (1, 100))
    return any(_values_equal(pred_value, gold_value, sp, sg) for sp, sg in scales)


def _split_percent(text: str) -> tuple[str, bool]:
    stripped = text.rstrip()
    return (stripped[:-1].rstrip(), True) if stripped.endswith("%") else (text, False)


def _value(text: str) -> _Num | Any | None:
    """A plain number (fast path), else a sympy expression, else None."""
    plain = _PLAIN_NUMBER_RE.fullmatch(text)
    if plain and abs(int(plain.group(1) or 0)) <= _MAX_FAST_EXPONENT:
        exact = not any(c in text for c in ".eE")
        return _Num(Fraction(text), exact)
    match = _INT_FRACTION_RE.fullmatch(text)
    if match:
        sign, num, den = match.group(1), match.group(2) or match.group(4), match.group(3) or match.group(5)
        if int(den) != 0:
            return _Num(Fraction(int(num), int(den)) * (-1 if sign == "-" else 1), True)
    return _sympy().parse_or_none(text)


def _values_equal(pred: Any, gold: Any, pred_scale: int, gold_scale: int) -> bool:
    if isinstance(pred, _Num) and isinstance(gold, _Num):
        a, b = pred.value / pred_scale, gold.value / gold_scale
        if pred.exact and gold.exact:
            return a == b
        return abs(a - b) <= REL_TOL_DECIMAL * max(abs(a), abs(b))
    return _sympy().expressions_equal(_to_sympy(pred) / pred_scale, _to_sympy(gold) / gold_scale)


def _to_sympy(value: Any) -> Any:
    return _sympy().from_fraction(value.value, value.exact) if isinstance(value, _Num) else value


def _equations_equal(pred: str, gold: str) -> bool:
    """``x^2+y^2=1`` vs ``y^2+x^2=1`` (or a multiple of it); both sides must be equations."""
    pred_sides, gold_sides = split_top(pred, "="), split_top(gold, "=")
    if len(pred_sides) != 2 or len(gold_sides) != 2:
        return False
    return _sympy().equations_equal(pred_sides, gold_sides)
