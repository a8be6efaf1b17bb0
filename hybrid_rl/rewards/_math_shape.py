"""The shape of an answer: scalar, tuple/interval, set, bare list, union of intervals, matrix.

Shapes decide how elements are matched: in order for tuples and intervals (whose brackets must
agree), as a multiset for sets and bare comma lists, row by row for matrices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Shape", "shape_of", "split_top"]

_OPEN = ("\\{", "\\langle", "(", "[", "{")
_CLOSE = ("\\}", "\\rangle", ")", "]", "}")
_RELATION_RE = re.compile(r"(\\le|\\ge|<|>)")
_VARIABLE_RE = re.compile(r"[a-zA-Z]|\\[a-zA-Z]+")
_MATRIX_RE = re.compile(r"\\begin\{([pbBvV]?matrix|array)\}(?:\{[^}]*\})?(.*)\\end\{\1\}", re.DOTALL)
_PLUS_MINUS_RE = re.compile(r"\\pm(?![a-zA-Z])")
_LHS_RE = re.compile(r"\s*(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?(?:\([a-zA-Z]\))?\s*(?:=|\\in(?![a-zA-Z]))\s*(?=\S)")


@dataclass(frozen=True)
class Shape:
    """``kind`` is scalar | tuple | set | list | union | matrix; ``items`` are strings (rows for a matrix,
    shapes for a union); ``brackets`` holds a tuple's opening and closing bracket, e.g. ``"[)"``."""

    kind: str
    items: tuple[Any, ...]
    brackets: str = ""


def _bracket_at(text: str, i: int, brackets: tuple[str, ...]) -> str | None:
    return next((b for b in brackets if text.startswith(b, i)), None)


def split_top(text: str, sep: str) -> list[str]:
    """Split at ``sep`` where no bracket is open (``(1,2), 3`` → ``["(1,2)", "3"]``)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        opener, closer = _bracket_at(text, i, _OPEN), _bracket_at(text, i, _CLOSE)
        if opener or closer:
            depth += 1 if opener else -1
            i += len(opener or closer or "")
            continue
        if text[i] == "\\" and not text.startswith(sep, i):
            i += 2
            continue
        if (
            depth == 0
            and text.startswith(sep, i)
            and not (sep[-1].isalpha() and text[i + len(sep) : i + len(sep) + 1].isalpha())
        ):
            parts.append(text[start:i].strip())
            start = i = i + len(sep)
            continue
        i += 1
    parts.append(text[start:].strip())
    return parts


def _encloses(text: str, open_len: int) -> bool:
    """Whether the bracket opening ``text`` closes at its very end (``(1)+(2)`` is not enclosed)."""
    depth, i = 0, 0
    while i < len(text):
        opener, closer = _bracket_at(text, i, _OPEN), _bracket_at(text, i, _CLOSE)
        if opener or closer:
            depth += 1 if opener else -1
            i += len(opener or closer or "")
            if depth == 0:
                return i == len(text)
            continue
        i += 2 if text[i] == "\\" else 1
    return False


def _items(inner: str) -> tuple[str, ...]:
    return tuple(p for p in split_top(inner, ",") if p)


def _matrix(text: str) -> Shape | None:
    match = _MATRIX_RE.fullmatch(text)
    if match is None:
        return None
    rows = [r for r in (row.strip() for row in match.group(2).split("\\\\")) if r and r != "\\hline"]
    return Shape("matrix", tuple(tuple(c.strip() for c in row.split("&")) for row in rows))


def _relation_interval(text: str) -> Shape | None:
    """``x > 3`` → ``(3, \\infty)``; ``1 \\le x < 2`` → ``[1, 2)``: one variable, one or two bounds."""
    parts = [p.strip() for p in _RELATION_RE.split(text)]
    lower = {"<": "(", "\\le": "["}
    upper = {"<": ")", "\\le": "]"}
    flip = {">": "<", "\\ge": "\\le", "<": ">", "\\le": "\\ge"}
    if len(parts) == 3 and _VARIABLE_RE.fullmatch(parts[2]) and not _VARIABLE_RE.fullmatch(parts[0]):
        parts = [parts[2], flip[parts[1]], parts[0]]
    if len(parts) == 3 and _VARIABLE_RE.fullmatch(parts[0]):
        _, op, bound = parts
        if op in upper:
            return Shape("tuple", ("-\\infty", bound), "(" + upper[op])
        return Shape("tuple", (bound, "\\infty"), lower[flip[op]] + ")")
    if len(parts) == 5 and _VARIABLE_RE.fullmatch(parts[2]):
        low, op1, _, op2, high = parts
        if op1 in flip and op2 in flip and op1 in upper and op2 in upper:
            return Shape("tuple", (low, high), lower[op1] + upper[op2])
        if op1 not in upper and op2 not in upper:
            return Shape("tuple", (high, low), lower[flip[op2]] + upper[flip[op1]])
    return None


def strip_lhs(text: str) -> str:
    """``x = 3`` → ``3``; ``x \\in [1, 2]`` → ``[1, 2]``; keeps equations whose left side is not a name."""
    match = _LHS_RE.match(text)
    return text[match.end() :] if match and "=" not in text[match.end() :] else text


def shape_of(text: str) -> Shape:
    """Classify one normalised answer."""
    t = strip_lhs(text).strip()
    if t in ("\\emptyset", "\\{\\}", "\\{ \\}"):
        return Shape("set", ())
    if t.startswith("\\begin{"):
        return _matrix(t) or Shape("scalar", (t,))
    parts = split_top(t, "\\cup")
    if len(parts) > 1:
        return Shape("union", tuple(shape_of(p) for p in parts))
    if t.startswith("\\{") and t.endswith("\\}") and _encloses(t, 2):
        return Shape("set", _items(t[2:-2]))
    if t[:1] in "([" and t[-1:] in ")]" and _encloses(t, 1) and len(_items(t[1:-1])) >= 2:
        return Shape("tuple", _items(t[1:-1]), t[0] + t[-1])
    if t.startswith("\\langle") and t.endswith("\\rangle") and _encloses(t, 7):
        return Shape("tuple", _items(t[7:-7]), "<>")
    items = _items(t)
    if len(items) > 1:
        return Shape("list", items)
    if _RELATION_RE.search(t):
        return _relation_interval(t) or Shape("scalar", (t,))
    if len(_PLUS_MINUS_RE.findall(t)) == 1:
        return Shape("set", (_PLUS_MINUS_RE.sub("+", t), _PLUS_MINUS_RE.sub("-", t)))
    return Shape("scalar", (t,))
