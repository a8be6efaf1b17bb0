"""Byte units the planner prints in."""

from __future__ import annotations

GIB = 2**30


def fmt(n: float) -> str:
    """Bytes as GiB (or MiB below 1 GiB): '12.30 GiB', '45.6 MiB'."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"
