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

from hybrid_rl.planner.units import GIB
from hybrid_rl.utils import memory


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


# A phase may measure this much above its plan before the run says so. On CUDA the reading is PyTorch's peak
# allocation, while the plan's total also holds what PyTorch does not count (the CUDA context, what vLLM keeps
# asleep), so a phase the plan covers measures below its total.
OVER_PLAN_SLACK = 1.05


class PlanWatch:
    """Says once per phase when a phase's measured peak exceeds `OVER_PLAN_SLACK` x its plan.

    The plan decided that the run fits, and how much vLLM gets; a phase above it is one the plan under-counts,
    which a longer response or a fuller micro-batch later can turn into an out-of-memory error days into a run.
    On the GPU, one did (tests/gpu: an update whose activation checkpointing had been switched off measured 48.7
    GiB against its plan's 33.3). Off on CPU (`enabled`), where the reading is the process's RSS, which the plan
    only approximates.
    """

    def __init__(self, planned_gib: dict[str, float], *, enabled: bool):
        self.planned, self.enabled = planned_gib, enabled
        self.said: set[str] = set()

    def check(self, measured_gib: dict[str, float]) -> list[str]:
        """The messages for phases newly found above their plan (phase -> measured peak GiB, this step's)."""
        if not self.enabled:
            return []
        out = []
        for phase, measured in measured_gib.items():
            planned = self.planned.get(phase)
            if planned is not None and measured > OVER_PLAN_SLACK * planned and phase not in self.said:
                self.said.add(phase)
                out.append(f"memory: the {phase} phase peaked at {measured:.2f} GiB, above the memory plan's "
                           f"{planned:.2f} GiB (the table printed at start-up): the plan under-counts this run, so its "
                           "verdict that the run fits, and vLLM's share, may not hold. Leave more room "
                           "(model.activation_checkpointing=true, a lower trainer.micro_batch_tokens or "
                           "rollout.gpu_memory_utilization), and please report it with the table.")
        return out
