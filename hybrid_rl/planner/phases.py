"""Every phase of an RL step, each the items the trainer ranks and vLLM hold in it."""

from __future__ import annotations

from hybrid_rl.planner.inputs import OFFLOADABLE, PlanInputs
from hybrid_rl.planner.moe import routes_items
from hybrid_rl.planner.result import Item, Phase
from hybrid_rl.planner.shards import shard_bytes, shard_rows
from hybrid_rl.planner.trainer_memory import params_label, process_items, trainer_items
from hybrid_rl.planner.vllm_memory import vllm_items

FRAGMENTATION = 0.05  # torch's caching allocator: share of the trainer's allocations lost to fragmentation


def _startup(x: PlanInputs) -> Phase:
    """While `build.py` loads the models: every model's shards, and one checkpoint read in flight (the
    block of rows and the file pages it maps)."""
    items, largest = [], 0
    for comp in ("actor", *OFFLOADABLE):
        spec = getattr(x, comp)
        if spec is None:
            continue
        items.append(Item(comp, params_label(spec), shard_bytes(spec.params, x.shard_ranks,
                                                                 param_bytes=spec.param_bytes,
                                                                 frozen_bytes=spec.frozen_param_bytes).params))
        largest = max([largest] + [shard_rows(p.shape[0], x.shard_ranks, 0)[0] * (p.numel // p.shape[0]) * 4
                                   for p in spec.params if p.shape])
    items.append(Item("loading", "checkpoint read (rows + mapped pages)", 2 * min(x.load_chunk_bytes, largest)))
    return Phase("startup", tuple(process_items(x, "startup") + items))


def _fragmentation(items: list[Item]) -> list[Item]:
    """torch's caching allocator keeps partly used segments of the trainer's churn (activations, compute copies)."""
    churn = sum(i.on_device for i in items if i.component not in ("process", "vllm"))
    return [Item("allocator", f"fragmentation ({FRAGMENTATION:.0%} of the trainer's)", int(FRAGMENTATION * churn))]


def phase(x: PlanInputs, name: str, *, first_step: bool = False) -> Phase:
    if name == "startup":
        return _startup(x)
    trainer = trainer_items(x, name, first_step=first_step) + routes_items(x, name)
    # Training phases churn the caching allocator; before the sync and the KV cache's wake-up the engine empties it.
    frag = _fragmentation(trainer) if x.device.kind == "cuda" and name not in ("sync", "rollout") else []
    return Phase(name, tuple(process_items(x, name) + trainer + frag + vllm_items(x, name)))


def phase_names(x: PlanInputs) -> list[str]:
    names = ["startup"] + (["sync", "rollout"] if x.rollout.enabled else [])
    if x.old_logp_pass:
        names.append("old_logp")
    names += [n for n in OFFLOADABLE if getattr(x, n) is not None or (n == "reference" and x.reference_from_actor)]
    names.append("update")
    return names + (["critic_update"] if x.critic is not None else [])


def step_phases(x: PlanInputs) -> tuple[Phase, ...]:
    """Every phase of a step (after the first: models offloaded after their passes are off the device)."""
    return tuple(phase(x, n) for n in phase_names(x))
