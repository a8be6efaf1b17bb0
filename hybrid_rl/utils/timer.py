"""Wall-clock timing of named phases (accelerator work included: CUDA is synchronised at the edges)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Accumulates seconds per phase name; `pop()` returns and clears them."""

    def __init__(self) -> None:
        self._t: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._t[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        self._t[name] += seconds

    def pop(self) -> dict[str, float]:
        out = dict(self._t)
        self._t.clear()
        return out
