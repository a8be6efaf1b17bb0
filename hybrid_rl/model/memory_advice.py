"""What to change when a phase does not fit, and what a reader of the plan should know. Pure.

Each fix is a modified `PlanInputs` run through the estimator again, so a saving is exactly what
the planner would predict after the change, in the phase that overflows (offloading the optimizer
state saves nothing in `update`, where the optimizer runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from hybrid_rl.model.memory_plan import (
    GIB,
    OFFLOADABLE,
    Fix,
    MemoryPlan,
    Phase,
    PlanInputs,
    estimate,
    frees_device,
    kv_cache_bytes,
    sync_reserve_bytes,
    vllm_utilization,
)

MAX_FIXES = 4  # per phase


def fmt(n: float) -> str:
    """Bytes as GiB (or MiB below 1 GiB): '12.30 GiB', '45.6 MiB'."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


def _candidates(x: PlanInputs) -> Iterator[tuple[str, PlanInputs]]:
    """(setting, inputs after it) for every change that can lower some phase."""
    target = "cpu" if x.device.kind == "cuda" else "disk"
    o = x.offload
    for name in ("actor_optim", "actor_params", *OFFLOADABLE):
        present = name.startswith("actor") or getattr(x, name) is not None
        if present and not frees_device(getattr(o, name), x.device):
            yield f"offload.{name}={target}", _with(x, offload=dataclasses.replace(o, **{name: target}))
    r = x.rollout
    if r.enabled and r.release == "keep":
        release = "sleep" if x.device.kind == "cuda" else "restart"
        yield f"rollout.release={release}", _with(x, rollout=dataclasses.replace(r, release=release))
    if not x.activation_checkpointing:
        yield "model.activation_checkpointing=true", _with(x, activation_checkpointing=True)
    half = x.micro_batch_tokens // 2
    if half >= x.max_sequence_tokens and half < x.update_tokens:
        yield (f"trainer.micro_batch_tokens={half}",
               _with(x, micro_batch_tokens=half, update_tokens=min(x.update_tokens, half),
                     pass_tokens=min(x.pass_tokens, half)))
    if r.enabled:
        d = x.actor.dims
        if d.num_heads % (2 * r.tp) == 0 and x.world % (2 * r.tp) == 0:
            yield f"rollout.tp={2 * r.tp}", _with(x, rollout=dataclasses.replace(r, tp=2 * r.tp))
        kv = kv_cache_bytes(x)
        if r.kv_cache_bytes is not None and kv > 0:
            yield (f"rollout.kv_cache_gb={kv / 2 / GIB:.3g}",
                   _with(x, rollout=dataclasses.replace(r, kv_cache_bytes=kv // 2)))
        elif r.kv_cache_bytes is None and r.gpu_memory_utilization is not None and r.gpu_memory_utilization > 0.2:
            util = round(r.gpu_memory_utilization - 0.1, 2)
            yield (f"rollout.gpu_memory_utilization={util}",
                   _with(x, rollout=dataclasses.replace(r, gpu_memory_utilization=util)))
    yield f"shard over {2 * x.world} ranks instead of {x.world}", _with(x, world=2 * x.world)


def _with(x: PlanInputs, **changes) -> PlanInputs:
    return dataclasses.replace(x, **changes)


def fixes_for(plan: MemoryPlan) -> Iterator[Fix]:
    """For each phase over the device's memory: the changes that lower it most, largest first."""
    over = [p for p in plan.phases if p.total > plan.device_bytes]
    if not over:
        return
    after = [(setting, estimate(x, with_fixes=False)) for setting, x in _candidates(plan.inputs)]
    for phase in over:
        found = []
        for setting, new in after:
            same = [p for p in new.phases if p.name == phase.name]
            saves = phase.total - (same[0].total if same else 0)
            if saves > 0:
                found.append(Fix(phase.name, setting, saves))
        yield from sorted(found, key=lambda f: -f.saves)[:MAX_FIXES]


def notes_for(plan: MemoryPlan, first_rollout: Phase | None) -> Iterator[str]:
    x = plan.inputs
    if first_rollout is not None and first_rollout.total > plan.phase("rollout").total:
        yield (f"step 1: reference / critic / reward model are offloaded only after their first pass, so the "
               f"first rollout also holds them: {fmt(first_rollout.total)} (later steps: "
               f"{fmt(plan.phase('rollout').total)})")
    yield from _activation_note(x)
    for name in ("actor_params", "actor_grads", "actor_optim", *OFFLOADABLE):
        if getattr(x.offload, name) == "cpu" and x.device.kind == "cpu":
            yield f"offload.{name}=cpu frees nothing on a CPU-only device (use disk)"
    if x.offload.actor_grads != "none":
        yield ("offload.actor_grads has nothing to move: gradients are freed after every optimizer step "
               "(zero_grad(set_to_none=True)) and do not exist in rollout")
    yield from _kv_note(x)


def _activation_note(x: PlanInputs) -> Iterator[str]:
    from hybrid_rl.model.activations import train_activations

    a = x.actor
    plain, ckpt = (train_activations(a.dims, x.update_tokens, b=x.compute_bytes, attention=x.attention,
                                     checkpointing=c, entropy=x.entropy).total for c in (False, True))
    yield (f"actor activations of one {x.update_tokens}-token micro-batch ({x.attention} attention): "
           f"{fmt(plain)} without, {fmt(ckpt)} with activation checkpointing; every token is counted as a "
           f"response token (upper bound of the vocabulary-sized log-prob tensors)")


def _kv_note(x: PlanInputs) -> Iterator[str]:
    r, d = x.rollout, x.actor.dims
    if not r.enabled:
        return
    kv_heads = max(d.num_kv_heads // r.tp, 1)
    per_token = 2 * d.num_layers * kv_heads * d.head_dim * r.dtype_bytes
    capacity = kv_cache_bytes(x) // per_token
    if r.kv_cache_bytes is None and r.gpu_memory_utilization is None:
        yield (f"rollout.gpu_memory_utilization=auto: {vllm_utilization(x):.2f} of the device, the memory the trainer "
               f"leaves free at the first sync less {fmt(sync_reserve_bytes(r.bucket_bytes))} for the sync; at run "
               "time it is measured when vLLM starts (minus the CUDA context and NCCL buffers)")
    line = f"KV cache {fmt(kv_cache_bytes(x))} holds {capacity} tokens per TP group"
    if r.max_model_len and capacity < r.max_model_len:
        line += f"; fewer than one sequence of max_model_len={r.max_model_len}: vLLM will refuse to start"
    yield line


def unlisted(kind: str) -> str:
    """What the plan leaves out, so a measured peak above it is not a surprise."""
    if kind == "cuda":
        return ("not counted: CUDA context, NCCL buffers and vLLM's own workspace (typically 1-3 GiB), "
                "allocator fragmentation")
    return ("not counted: the process itself (torch + transformers alone: ~0.4 GiB RSS; vLLM adds more) and memory "
            "glibc keeps after frees (peak RSS can run well above the plan; MALLOC_MMAP_THRESHOLD_=65536 makes "
            "it track the plan)")

