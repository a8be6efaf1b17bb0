"""`estimate(inputs)`: the per-rank memory of every phase, with notes and (when something does not fit) fixes."""

from __future__ import annotations

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
