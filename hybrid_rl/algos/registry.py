"""Name -> function lookup shared by every registry in `hybrid_rl.algos`.

A recipe names its estimator, KL estimator or aggregation mode with a string. An unknown name is a
configuration error, so it raises `ValueError` listing the known names (the fix-it message), rather
than a bare `KeyError` from deep inside a loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup(table: Mapping[str, T], name: str, *, kind: str) -> T:
    """Return `table[name]`, or raise `ValueError` naming `kind` and listing the known names."""
    try:
        return table[name]
    except KeyError:
        known = ", ".join(repr(k) for k in sorted(table))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None
