"""`estimate(inputs)`: the per-rank memory of every phase, with notes and (when something does not fit) fixes."""

from __future__ import annotations

import dataclasses

from hybrid_rl.planner.advice import fixes_for, notes_for
from hybrid_rl.planner.inputs import PlanInputs
from hybrid_rl.planner.phases import phase, step_phases
from hybrid_rl.planner.result import MemoryPlan


def estimate(x: PlanInputs, *, with_fixes: bool = True) -> MemoryPlan:
    """The per-rank memory of every phase, with notes and (when something does not fit) the fixes."""
    phases = step_phases(x)
    plan = MemoryPlan(x, phases)
    first = phase(x, "rollout", first_step=True) if x.rollout.enabled else None
    notes = tuple(notes_for(plan, first))
    fixes = tuple(fixes_for(plan)) if with_fixes else ()
    return MemoryPlan(x, phases, notes, fixes)


def choose_shard(x: PlanInputs) -> PlanInputs:
    """`x` with its FSDP layout decided: `x.shard` where set (trainer.shard_size), else (0, auto) the smallest shard
    size dividing the world whose plan fits, i.e. the most replicas: at 1 every rank holds the models whole and a
    step gathers nothing. None fits: sharded over every rank (its plan then lists the fixes)."""
    if x.shard:
        if x.shard < 0 or x.world % x.shard:
            raise ValueError(f"trainer.shard_size={x.shard} must divide the number of ranks ({x.world})")
        return x
    for s in (d for d in range(1, x.world) if x.world % d == 0):
        candidate = dataclasses.replace(x, shard=s)
        if estimate(candidate, with_fixes=False).fits:
            return candidate
    return dataclasses.replace(x, shard=x.world)
