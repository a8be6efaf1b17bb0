"""Measured peak memory of each phase of a step, to print beside the `MemoryPlan`'s prediction.

On CUDA the peak is `torch.cuda.max_memory_allocated()` (what the plan counts: tensors, not the
CUDA context); on CPU it is the peak RSS (`utils.memory`), which also holds the interpreter and
libraries and whatever glibc keeps after frees. Entering a phase resets the high-water mark, so
`step_peak` keeps the largest reading of the step for the `memory/peak_gib` metric.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybrid_rl.utils import memory

GIB = 2**30


def peak_reading() -> int:
    """The high-water mark now, in bytes: CUDA's peak allocation, or the process's peak RSS on CPU."""
    return memory.device_bytes()[1] if torch.cuda.is_available() else memory.peak_rss_bytes()


def _reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        memory.reset_peak_rss()


class PhasePeaks:
    """`with peaks.phase("update"): ...` records that phase's peak in GiB; `pop()` returns and clears them."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.step_peak = 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.step_peak = max(self.step_peak, peak_reading() / GIB)  # what came before this phase
        _reset()
        try:
            yield
        finally:
            peak = peak_reading() / GIB
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
            self.step_peak = max(self.step_peak, peak)

    def pop(self) -> tuple[dict[str, float], float]:
        """(phase -> peak GiB, the step's peak GiB including what ran outside the phases); then clears."""
        out, step_peak = dict(self.peaks), max(self.step_peak, peak_reading() / GIB)
        self.peaks.clear()
        self.step_peak = 0.0
        return out, step_peak
