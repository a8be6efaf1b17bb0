"""A `MemoryPlan` as text: one row per item, one column per phase, totals, the measured peaks and a verdict.

A cell is the item's size in that phase; the offload target (`cpu`, `disk`), `released` (vLLM in
train mode) or `asleep` (KV cache during the sync, sleep mode) when the item is held off the
device there; blank when the item does not exist in that phase.
"""

from __future__ import annotations

from hybrid_rl.planner.inputs import PlanInputs
from hybrid_rl.planner.result import MemoryPlan
from hybrid_rl.planner.units import GIB, fmt

LABEL = 46
MIN_CELL = 10


def render(plan: MemoryPlan, measured: dict[str, float] | None = None) -> str:
    """The table; `measured` maps phase names to measured peaks in GiB (phases it lacks stay blank)."""
    x = plan.inputs
    unit, scale = ("GiB", GIB) if max(plan.peak.total, plan.device_bytes) >= GIB else ("MiB", 2**20)
    names = [p.name for p in plan.phases]
    cell_width = max(MIN_CELL, *(len(n) + 1 for n in names))
    lines = [_title(plan), "", f"{'per rank, ' + unit:<{LABEL}}" + "".join(f"{n:>{cell_width}}" for n in names)]
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for phase in plan.phases:
        for item in phase.items:
            cell = item.offloaded[:cell_width - 1] if item.offloaded else f"{item.bytes / scale:.2f}"
            rows.setdefault((item.component, item.what), {})[phase.name] = cell
    for (component, what), cells in sorted(rows.items(), key=lambda kv: _order(*kv[0])):
        lines.append(f"{component + '  ' + what:<{LABEL}.{LABEL}}" + "".join(f"{cells.get(n, ''):>{cell_width}}"
                                                                           for n in names))
    lines.append("-" * (LABEL + cell_width * len(names)))
    lines.append(f"{'total (predicted)':<{LABEL}}" + "".join(f"{p.total / scale:>{cell_width}.2f}" for p in plan.phases))
    if measured:
        lines.append(f"{'measured peak':<{LABEL}}" + "".join(
            f"{measured[n] * GIB / scale:>{cell_width}.2f}" if n in measured else f"{'':>{cell_width}}" for n in names))
    lines.append(f"{'device memory per rank':<{LABEL}}" + f"{plan.device_bytes / scale:>{cell_width}.2f}")
    if plan.margin_bytes:
        lines.append(f"{'usable (less the safety margin)':<{LABEL}}" + f"{plan.usable_bytes / scale:>{cell_width}.2f}")
    lines += ["", verdict(plan)]
    lines += [f"  note: {n}" for n in plan.notes]
    lines.append(f"  {unlisted(x.device.kind, keeps_freed=plan.keeps_freed_host_memory)}")
    return "\n".join(lines)


COMPONENTS = ("process", "actor", "reference", "critic", "reward_model", "teacher", "routes", "allocator", "vllm",
              "loading")
ITEMS = ("CUDA", "NCCL", "params", "grads", "AdamW", "compute", "activations", "fragmentation", "weights", "KV",
         "kept", "runtime", "weight sync")


def _order(component: str, what: str) -> tuple[int, int]:
    return COMPONENTS.index(component), next((i for i, w in enumerate(ITEMS) if what.startswith(w)), len(ITEMS))


def _title(plan: MemoryPlan) -> str:
    x = plan.inputs
    r = x.rollout
    rollout = f", rollout tp={r.tp} release={r.release}" if r.enabled else ", no rollout"
    a = x.actor
    params = f"{a.numel / 1e6:.1f}M params" + (f", {a.active_numel / 1e6:.1f}M active" if a.dims.moe_layers else "")
    return (f"Memory plan per rank: {a.dims.architecture} ({params}), world "
            f"{x.world} ({layout(x)}), {x.device.name or x.device.kind} with {fmt(plan.device_bytes)}"
            f", compute {({2: '16-bit', 4: 'fp32'})[x.compute_bytes]}, {x.attention} attention{rollout}")


def layout(x: PlanInputs) -> str:
    """How FSDP splits the models over the ranks (`trainer.shard_size`), in words."""
    s = x.shard_ranks
    if s == x.world:
        return f"FSDP sharded over all {s} ranks" if s > 1 else "one rank, nothing sharded"
    if s == 1:
        return f"trainer.shard_size=1: every rank holds every model whole ({x.world} replicas; no gathers)"
    return f"trainer.shard_size={s}: HSDP, {x.world // s} replicas each sharded over {s} ranks"


def verdict(plan: MemoryPlan) -> str:
    peak, device, usable = plan.peak, plan.device_bytes, plan.usable_bytes
    margin = f", beyond the {fmt(plan.margin_bytes)} safety margin" if plan.margin_bytes else ""
    if plan.fits:
        return (f"FITS: peak {fmt(peak.total)} in {peak.name} of {fmt(device)} per rank "
                f"({fmt(usable - peak.total)} to spare{margin}); {layout(plan.inputs)}")
    lines = []
    for p in plan.phases:
        if p.total <= usable:
            continue
        largest = max((i for i in p.items if i.on_device), key=lambda i: i.bytes)
        lines.append(f"  {p.name} needs {fmt(p.total)} ({fmt(p.total - usable)} over{margin}; largest item "
                     f"{largest.component} {largest.what} {fmt(largest.bytes)})")
    if plan.fixes:
        fits = plan.fixes[-1].fits
        lines.append("  to fit, cheapest in speed first:" if fits else
                     "  these help, cheapest in speed first, but even all together it does not fit:")
        lines += [f"    {f.setting}  (saves {fmt(f.saves)}; {f.cost})" for f in plan.fixes]
        if fits:
            ranks = [f.setting.split()[2] for f in plan.fixes if f.setting.startswith("shard")]
            where = f", on {ranks[-1]} ranks" if ranks else ""
            lines.append(f"    all on one command line{where}: " + " ".join(f.setting for f in plan.fixes
                                                                            if not f.setting.startswith("shard")))
    else:
        lines.append("  no setting this planner knows lowers it: use more ranks or larger devices")
    return f"DOES NOT FIT in {fmt(device)} per rank:\n" + "\n".join(lines)


def unlisted(kind: str, *, keeps_freed: bool = False) -> str:
    """What the plan leaves out, so a measured peak above it is not a surprise."""
    if kind == "cuda":
        return ("CUDA context, NCCL communicators, what vLLM keeps asleep and fragmentation are typical figures "
                "(not measured on a GPU), hence the safety margin; check them against a "
                "run's first-step table (measured peak row) and vLLM's log (CUDA graph pool)")
    if keeps_freed:
        return ("measured on CPU as each rank's peak RSS; not counted: what glibc keeps after frees (twice the peak "
                "fits, so freed buffers up to 32 MiB stay mapped for reuse: fewer page faults, a higher RSS)")
    return ("measured on CPU as each rank's peak RSS; not counted: small allocations glibc keeps after frees "
            "(hybrid_rl sets malloc to return every freed buffer of 1 MiB or more at once)")
