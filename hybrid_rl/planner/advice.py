"""What to change when a phase does not fit, and what a reader of the plan should know. Pure.

Each fix is a modified `PlanInputs` run through the estimator again, so a saving is exactly what
the planner would predict after the change, in the phase that overflows (offloading the optimizer
state saves nothing in `update`, where the optimizer runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from hybrid_rl.planner.activations import train_activations
from hybrid_rl.planner.inputs import OFFLOADABLE, PlanInputs, frees_device
from hybrid_rl.planner.moe import moe_notes
from hybrid_rl.planner.phases import step_phases
from hybrid_rl.planner.result import Fix, MemoryPlan, Phase
from hybrid_rl.planner.trainer_memory import host_offload_bytes
from hybrid_rl.planner.units import GIB, fmt
from hybrid_rl.planner.vllm_memory import kv_cache_bytes, plan_sync_reserve, vllm_host_bytes, vllm_utilization

# What each kind of change costs in speed, cheapest first (the order fixes are tried and listed in).
COST = {
    "offload.reference": (1, "moves the reference to {target} and back around its pass"),
    "offload.reward_model": (1, "moves the reward model to {target} and back around its pass"),
    "offload.teacher": (1, "moves the distillation teacher to {target} and back around its pass"),
    "offload.critic": (2, "moves the critic and its AdamW state to {target} and back around its pass and update"),
    "trainer.micro_batch_tokens": (2, "more, smaller micro-batches"),
    "rollout.kv_cache_gb": (3, "fewer sequences decoded at once"),
    "rollout.gpu_memory_utilization": (3, "fewer sequences decoded at once"),
    "offload.actor_optim": (3, "moves the AdamW state to {target} and back around every rollout"),
    "optim.name": (3, "8-bit AdamW moments (torchao): a quarter of the state, a slightly coarser update"),
    # Adapter sync moves less at every update; what it costs is vLLM's LoRA kernels at decode (benchmarks/README.md).
    "model.lora.sync": (2, "vLLM serves the adapter on the base (sent once): slower LoRA decode, no merge per update"),
    # First: recomputing blocks costs about a third more *update* compute, a small share of an RL step that
    # rollout dominates, and moves nothing over PCIe.
    "model.activation_checkpointing": (0, "recomputes every block in backward (about a third more update compute)"),
    "offload.actor_params": (5, "moves the policy's shards to {target} and back around every rollout"),
    "rollout.tp": (5, "tensor-parallel decoding: fewer vLLM replicas, an all-reduce per layer"),
    "rollout.release": (6, "releases vLLM in every train phase ({release}; restart rebuilds it at every step)"),
    "trainer.shard_size": (4, "FSDP gathers each block in every pass and reduce-scatters its gradients"),
    "shard": (9, "needs twice the ranks"),
}
MAX_FIXES = 8
MIN_SAVING = 0.01  # of the device: changes that save less are not worth listing


def _candidates(x: PlanInputs) -> Iterator[tuple[str, str, PlanInputs]]:
    """(setting, its COST key, inputs after it) for every change that can lower some phase."""
    target = "cpu" if x.device.kind == "cuda" else "disk"
    o = x.offload
    for name in ("actor_optim", "actor_params", *OFFLOADABLE):
        present = name.startswith("actor") or getattr(x, name) is not None
        if present and not frees_device(getattr(o, name), x.device):
            yield (f"offload.{name}={target}", f"offload.{name}",
                   _with(x, offload=dataclasses.replace(o, **{name: target})))
    if x.optimizer != "adamw8bit":
        yield "optim.name=adamw8bit", "optim.name", _with(x, optimizer="adamw8bit")
    r = x.rollout
    if r.enabled and x.actor.lora_rank and not r.lora_adapter:
        yield "model.lora.sync=adapter", "model.lora.sync", _with(x, rollout=dataclasses.replace(r, lora_adapter=True))
    if r.enabled and r.release == "keep":
        release = "sleep" if x.device.kind == "cuda" else "restart"
        yield f"rollout.release={release}", "rollout.release", _with(x, rollout=dataclasses.replace(r, release=release))
    if not x.activation_checkpointing:
        yield "model.activation_checkpointing=true", "model.activation_checkpointing", \
            _with(x, activation_checkpointing=True)
    half = x.micro_batch_tokens // 2
    if half >= x.max_sequence_tokens and half < x.update_tokens:
        yield (f"trainer.micro_batch_tokens={half}", "trainer.micro_batch_tokens",
               _with(x, micro_batch_tokens=half, update_tokens=min(x.update_tokens, half),
                     pass_tokens=min(x.pass_tokens, half), update_responses=_scaled(x.update_responses, half,
                                                                                     x.update_tokens),
                     pass_responses=_scaled(x.pass_responses, min(x.pass_tokens, half), x.pass_tokens)))
    if r.enabled:
        d = x.actor.dims
        if d.num_heads % (2 * r.tp) == 0 and x.world % (2 * r.tp) == 0:
            yield f"rollout.tp={2 * r.tp}", "rollout.tp", _with(x, rollout=dataclasses.replace(r, tp=2 * r.tp))
        kv = kv_cache_bytes(x)
        if r.kv_cache_bytes is not None and kv > 2**27:
            yield (f"rollout.kv_cache_gb={kv / 2 / GIB:.3g}", "rollout.kv_cache_gb",
                   _with(x, rollout=dataclasses.replace(r, kv_cache_bytes=kv // 2)))
        elif r.kv_cache_bytes is None and r.gpu_memory_utilization is not None and r.gpu_memory_utilization > 0.2:
            util = round(r.gpu_memory_utilization - 0.1, 2)
            yield (f"rollout.gpu_memory_utilization={util}", "rollout.gpu_memory_utilization",
                   _with(x, rollout=dataclasses.replace(r, gpu_memory_utilization=util)))
    if x.shard_ranks < x.world:  # HSDP with replicas: shard over more of the ranks there are first
        yield f"trainer.shard_size={x.world}", "trainer.shard_size", _with(x, shard=x.world)
    else:
        yield f"shard over {2 * x.world} ranks instead of {x.world}", "shard", _with(x, world=2 * x.world)


def _scaled(responses: int | None, tokens: int, old_tokens: int) -> int | None:
    return None if responses is None else max(1, responses * tokens // max(old_tokens, 1))


def _with(x: PlanInputs, **changes) -> PlanInputs:
    return dataclasses.replace(x, **changes)


def _peak(x: PlanInputs) -> int:
    return max(p.total for p in step_phases(x))


def fixes_for(plan: MemoryPlan) -> list[Fix]:
    """When the plan does not fit: changes that together make it fit, listed cheapest in speed first.

    Each round tries every change on the configuration so far (each a re-run of the estimator): if some
    change alone makes it fit, the cheapest of those (`COST`) ends the search; otherwise the change that
    lowers the peak most is applied and the search goes on. Each `Fix` says what its change saved on top of
    the ones before it; the same knob changed twice is one line.
    """
    x, device = plan.inputs, plan.usable_bytes
    peak, applied = _peak(x), []
    for _ in range(MAX_FIXES):
        if peak <= device:
            break
        options = [(COST[kind][0], _peak(after), setting, kind, after) for setting, kind, after in _candidates(x)]
        # A change that makes the run fit is worth listing however little it saves (merging no LoRA layer, say).
        options = [o for o in options if o[1] <= device or o[1] < peak - MIN_SAVING * device]
        if not options:
            break
        fitting = [o for o in options if o[1] <= device]
        rank, new_peak, setting, kind, x = min(fitting, key=lambda o: (o[0], o[1])) if fitting else \
            min(options, key=lambda o: o[1])
        phase = max(step_phases(x), key=lambda p: p.total).name
        cost = COST[kind][1].format(target="cpu" if device_kind(plan) == "cuda" else "disk",
                                    release="sleep" if device_kind(plan) == "cuda" else "restart")
        key = setting.split("=")[0]
        same = [i for i, (_, f) in enumerate(applied) if f.setting.split("=")[0] == key]
        if same:  # the same knob again (micro-batches halved twice, TP doubled twice): one line, its last value
            prev = applied.pop(same[0])[1]
            applied.append((rank, Fix(prev.phase, setting, prev.saves + peak - new_peak, cost)))
        else:
            applied.append((rank, Fix(phase, setting, peak - new_peak, cost)))
        peak = new_peak
    fixes = [f for _, f in sorted(applied, key=lambda a: a[0])]
    if fixes and peak <= device:
        fixes[-1] = dataclasses.replace(fixes[-1], fits=True)
    return fixes


def device_kind(plan: MemoryPlan) -> str:
    return plan.inputs.device.kind


def notes_for(plan: MemoryPlan, first_rollout: Phase | None) -> Iterator[str]:
    x = plan.inputs
    if first_rollout is not None and first_rollout.total > plan.phase("rollout").total:
        yield (f"step 1: reference / critic / reward model are offloaded only after their first pass, so the "
               f"first rollout also holds them: {fmt(first_rollout.total)} (later steps: "
               f"{fmt(plan.phase('rollout').total)})")
    yield from moe_notes(x)
    yield from _activation_note(x)
    for name in ("actor_params", "actor_grads", "actor_optim", *OFFLOADABLE):
        if getattr(x.offload, name) == "cpu" and x.device.kind == "cpu":
            yield f"offload.{name}=cpu frees nothing on a CPU-only device (use disk)"
    host = host_offload_bytes(x) | vllm_host_bytes(x)
    if host:
        parts = ", ".join(f"{k} {fmt(v)}" for k, v in host.items())
        yield (f"host memory per rank: {fmt(sum(host.values()))} of pinned buffers ({parts}), held for the "
               "run; a node needs that times its local ranks beyond the processes themselves")
    if x.offload.actor_grads != "none":
        yield ("offload.actor_grads has nothing to move: gradients are freed after every optimizer step "
               "(zero_grad(set_to_none=True)) and do not exist in rollout")
    yield from _kv_note(x)


def _activation_note(x: PlanInputs) -> Iterator[str]:
    a = x.actor
    plain, ckpt = (train_activations(a.dims, x.update_tokens, b=x.compute_bytes, attention=x.attention,
                                     checkpointing=c, entropy=x.entropy, responses=x.update_responses,
                                     math_len=x.math_len, extra_rows=x.extra_rows(x.update_tokens)).total
                   for c in (False, True))
    responses = "every token" if x.update_responses is None else f"{x.update_responses} tokens"
    yield (f"actor activations of one {x.update_tokens}-token micro-batch ({x.attention} attention): "
           f"{fmt(plain)} without, {fmt(ckpt)} with activation checkpointing ({responses} counted as response "
           f"tokens, the ones with vocabulary-sized log-prob tensors)")


def _kv_note(x: PlanInputs) -> Iterator[str]:
    r, d = x.rollout, x.actor.dims
    if not r.enabled:
        return
    kv_heads = max(d.num_kv_heads // r.tp, 1)
    per_token = 2 * d.num_layers * kv_heads * d.head_dim * r.dtype_bytes
    capacity = kv_cache_bytes(x) // per_token
    if r.kv_cache_bytes is None and r.gpu_memory_utilization is None:
        yield (f"rollout.gpu_memory_utilization=auto: {vllm_utilization(x):.2f} of the device, the memory the trainer "
               f"leaves free at the first sync (the actor's and critic's optimizer state counted unless offloaded: it is "
               f"resident at every later rollout) less {fmt(plan_sync_reserve(x))} for the sync and the safety margin; at "
               "run time, in both deployments, the same rule is applied to the memory measured when vLLM starts, less "
               "the optimizer state still to come and NCCL's point-to-point connections")
    line = f"KV cache {fmt(kv_cache_bytes(x))} holds {capacity} tokens per TP group"
    if r.max_model_len and capacity < r.max_model_len:
        line += f"; fewer than one sequence of max_model_len={r.max_model_len}: vLLM will refuse to start"
    yield line

