"""Value equality of parsed answers with sympy: exact where both are exact, else within tolerance.

Expressions with free symbols are compared at fixed points (deterministic, so a reward never
flips between runs); ``simplify`` is a last resort where the points cannot be evaluated.
Callers run all of this under ``time_limit``.
"""

from __future__ import annotations

import cmath
import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import sympy as sp

from hybrid_rl.rewards._math_compare import REL_TOL_DECIMAL
from hybrid_rl.rewards._math_parse import parse_latex

__all__ = ["equations_equal", "expressions_equal", "from_fraction", "parse_or_none"]

REL_TOL_EXACT = 1e-20  # both exact: numeric evaluation at 40 digits stands in for a proof
_DIGITS = 40
_NUM_POINTS = 3


def parse_or_none(text: str) -> sp.Expr | None:
    try:
        return parse_latex(text)
    except (Exception, RecursionError):  # any failure of an odd answer means "not an expression"
        return None


def from_fraction(value: Fraction, exact: bool) -> sp.Expr:
    number = sp.Rational(value.numerator, value.denominator)
    return number if exact else sp.Float(number, 30)


def _points(symbols: Sequence[sp.Symbol]) -> list[dict[sp.Symbol, sp.Float]]:
    """Positive, irrational-looking values (so sqrt(x^2) = x holds, as most graders assume)."""
    golden = 0.6180339887498949
    return [
        {s: sp.Float(1 + 2 * (((j * 7 + k * 3 + 1) * golden) % 1), _DIGITS) for k, s in enumerate(symbols)}
        for j in range(_NUM_POINTS)
    ]


_FLOAT_FUNCS: dict[Any, Callable[..., complex]] = {
    sp.sin: cmath.sin, sp.cos: cmath.cos, sp.tan: cmath.tan, sp.asin: cmath.asin, sp.acos: cmath.acos,
    sp.atan: cmath.atan, sp.sinh: cmath.sinh, sp.cosh: cmath.cosh, sp.tanh: cmath.tanh, sp.exp: cmath.exp,
    sp.log: cmath.log, sp.Abs: abs, sp.cot: lambda x: 1 / cmath.tan(x), sp.sec: lambda x: 1 / cmath.cos(x),
    sp.csc: lambda x: 1 / cmath.sin(x), sp.floor: lambda x: math.floor(x.real), sp.ceiling: lambda x: math.ceil(x.real),
    sp.factorial: lambda x: math.gamma(x.real + 1), sp.binomial: lambda n, k: math.comb(int(n.real), int(k.real)),
}  # fmt: skip
_UNKNOWN = object()


def _magnitude_ok(expr: sp.Expr, point: dict[sp.Symbol, sp.Float]) -> bool:
    """Whether every node of ``expr`` stays below 1e300 in double precision at ``point``.

    Why: sympy's evalf would compute a tower like x^(x^(x^x)) exactly in mpmath, in C, for as long
    and as much memory as it takes; no time limit can stop that. Floats overflow instead.
    """
    return _approx(expr, point) is not None


def _approx(expr: Any, point: dict[sp.Symbol, sp.Float]) -> Any:
    try:
        if expr.is_Symbol:
            return complex(point[expr])
        if expr.is_number and not expr.args:
            value: Any = complex(expr)
        else:
            args = [_approx(a, point) for a in expr.args]
            if any(a is None for a in args):
                return None
            if any(a is _UNKNOWN for a in args):
                return _UNKNOWN
            if expr.is_Add:
                value = sum(args)
            elif expr.is_Mul:
                value = math.prod(args)
            elif expr.is_Pow:
                value = args[0] ** args[1]
            elif expr.func in _FLOAT_FUNCS:
                value = _FLOAT_FUNCS[expr.func](*args)
            else:
                return _UNKNOWN  # a node we cannot estimate: let evalf try
    except (OverflowError, ZeroDivisionError, ValueError, TypeError, KeyError):
        return None
    return value if abs(value) < 1e300 else None


def _evaluate(expr: sp.Expr, point: dict[sp.Symbol, sp.Float]) -> sp.Expr | None:
    if not _magnitude_ok(expr, point):
        return None
    try:
        value = expr.evalf(_DIGITS, subs=point) if point else expr.evalf(_DIGITS)
    except Exception:
        return None
    return value if value.is_number and value is not sp.nan and not value.has(sp.nan) else None


def _close(a: sp.Expr, b: sp.Expr, rel_tol: float) -> bool:
    if a.is_infinite or b.is_infinite or a.has(sp.zoo) or b.has(sp.zoo):
        return bool(a == b)
    diff = abs(a - b)
    floor = 1e-12 if rel_tol == REL_TOL_DECIMAL else 1e-30
    return bool(diff <= rel_tol * max(abs(a), abs(b))) or bool(diff <= floor)


def expressions_equal(a: sp.Expr, b: sp.Expr) -> bool:
    """Same value (numbers) or same function (expressions in variables)."""
    if a == b:
        return True
    inexact = a.has(sp.Float) or b.has(sp.Float)
    if not inexact and a.is_Rational and b.is_Rational:
        return False
    tol = REL_TOL_DECIMAL if inexact else REL_TOL_EXACT
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    agreed, needed = 0, 2 if symbols else 1
    for point in _points(symbols) if symbols else [{}]:
        va, vb = _evaluate(a, point), _evaluate(b, point)
        if va is None or vb is None:
            continue
        if not _close(va, vb, tol):
            return False
        agreed += 1
    return agreed >= needed or _simplifies_to_zero(a - b)


def _simplifies_to_zero(expr: sp.Expr) -> bool:
    try:
        return bool(sp.simplify(expr) == 0)
    except Exception:
        return False


def equations_equal(pred_sides: Sequence[str], gold_sides: Sequence[str]) -> bool:
    """``L1 = R1`` against ``L2 = R2``: (L1 - R1) is a nonzero constant multiple of (L2 - R2)."""
    exprs = [parse_or_none(s) for s in (*pred_sides, *gold_sides)]
    if any(e is None for e in exprs):
        return False
    pred, gold = exprs[0] - exprs[1], exprs[2] - exprs[3]
    if pred == gold or pred == -gold:
        return True
    symbols = sorted(pred.free_symbols | gold.free_symbols, key=str)
    ratios = []
    for point in _points(symbols) if symbols else []:
        vp, vg = _evaluate(pred, point), _evaluate(gold, point)
        if vp is not None and vg is not None and vg != 0 and not vg.is_infinite:
            ratios.append(vp / vg)
    first = ratios[0] if ratios else sp.Integer(0)
    return len(ratios) >= 2 and first != 0 and all(_close(r, first, REL_TOL_DECIMAL) for r in ratios)
