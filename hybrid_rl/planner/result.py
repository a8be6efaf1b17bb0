"""The plan as data: the items of each phase, the fixes, and whether the peak fits. Read by `advice` and `table`."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_rl.planner.inputs import DeviceSpec, PlanInputs
from hybrid_rl.planner.shards import ShardBytes, shard_bytes

SAFETY_MARGIN = 0.05  # of a GPU: kept free beyond every counted item (a plan with less than this does not fit)


@dataclass(frozen=True)
class Item:
    component: str  # actor | reference | critic | reward_model | vllm
    what: str
    bytes: int
    offloaded: str = ""  # the offload target when the item is off the device in this phase

    @property
    def on_device(self) -> int:
        return 0 if self.offloaded else self.bytes


@dataclass(frozen=True)
class Phase:
    name: str
    items: tuple[Item, ...]

    @property
    def total(self) -> int:
        return sum(i.on_device for i in self.items)


@dataclass(frozen=True)
class Fix:
    phase: str  # the phase that peaked before this change
    setting: str  # what to change, as a command-line override where there is one
    saves: int  # off the peak, on top of the fixes listed before it
    cost: str = ""  # what it costs in speed
    fits: bool = False  # the plan fits once this and the fixes before it are applied


@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    phases: tuple[Phase, ...]
    notes: tuple[str, ...] = ()
    fixes: tuple[Fix, ...] = ()  # for each phase that does not fit, largest saving first

    @property
    def device_bytes(self) -> int:
        return self.inputs.device.total_bytes

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def margin_bytes(self) -> int:
        """Kept free beyond every counted item: `SAFETY_MARGIN` of a GPU (none on CPU, measured as RSS)."""
        return safety_margin_bytes(self.inputs.device)

    @property
    def usable_bytes(self) -> int:
        return self.device_bytes - self.margin_bytes

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.usable_bytes

    @property
    def keeps_freed_host_memory(self) -> bool:
        """CPU: the run can let glibc keep freed buffers for reuse (`utils.env.keep_freed_memory`) instead of
        returning every one of 1 MiB or more to the OS at once. Kept memory stays mapped through later phases, so
        a rank may hold up to its largest phase's peak again on top of any phase: allowed when twice the peak fits."""
        return self.inputs.device.kind == "cpu" and 2 * self.peak.total <= self.usable_bytes

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def memory(self, component: str, rank: int = 0) -> ShardBytes:
        """Exact per-rank params / grads / optimizer bytes of one model."""
        spec = getattr(self.inputs, component)
        return shard_bytes(spec.params, self.inputs.shard_ranks, rank, param_bytes=spec.param_bytes,
                           frozen_bytes=spec.frozen_param_bytes, optimizer=self.inputs.optimizer)


def safety_margin_bytes(device: DeviceSpec) -> int:
    return int(SAFETY_MARGIN * device.total_bytes) if device.kind == "cuda" else 0
