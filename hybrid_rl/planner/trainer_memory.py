"""What a trainer rank holds in a phase: its process, every model's shards, compute copies and activations."""

from __future__ import annotations

import dataclasses

from hybrid_rl.distributed.shm_comms import AG_SLOTS
from hybrid_rl.model.optimizers import OPTIMIZERS
from hybrid_rl.planner.activations import forward_activations, train_activations
from hybrid_rl.planner.inputs import OFFLOADABLE, ModelSpec, PlanInputs, frees_device
from hybrid_rl.planner.result import Item
from hybrid_rl.planner.shards import shard_bytes
from hybrid_rl.planner.units import GIB

# Host memory of a rank's process before any model (CPU plans count RSS): python, torch and transformers, and what
# importing vLLM adds (what a started vLLM adds beyond its weights and KV cache: `vllm_memory.CPU_VLLM_RUNTIME_*`).
CPU_PROCESS_BYTES = int(0.43 * GIB)
CPU_VLLM_IMPORT_BYTES = int(0.18 * GIB)
# CUDA figures no CPU can measure (nor did the project's one GPU run, tests/gpu, which read PyTorch's allocations only):
# typical values, stated so a user can check them against a run's own log (vLLM logs its graph pool; `nvidia-smi`
# shows the context) and adjust the margin.
CUDA_CONTEXT_BYTES = int(0.6 * GIB)  # CUDA context + torch's and NCCL's kernels (CUDA 12 lazy loading), per GPU
# One NCCL communicator on an NVLink node: NCCL_BUFFSIZE (4 MiB) x send/recv x up to 32 channels, plus its
# proxy and work FIFOs. A rank joins: the trainer's world group (FSDP's collectives) and its point-to-point
# channels (the resharder's all-to-all); with rollout.tp > 1 vLLM's TP group twice (its PyNccl communicator and
# torch's group), plus vLLM's custom all-reduce IPC buffers.
NCCL_COMMUNICATOR_BYTES = int(0.3 * GIB)
# The resharder's all-to-all connects each rank to every peer point to point, lazily, inside the first weight sync
# (after vLLM measured its share): per peer NCCL_BUFFSIZE (4 MiB) x send/recv x its point-to-point channels
# (typically 4 on NVLink). A typical figure, like the two above.
NCCL_P2P_PER_PEER_BYTES = 32 * 2**20
VLLM_CUSTOM_ALLREDUCE_BYTES = 64 * 2**20


def _copies(spec: ModelSpec, b: int, *, train: bool, whole: bool = False) -> int:
    """FSDP's unsharded compute copies: the root, the running block and the prefetched one; in
    backward also one block's unsharded grads, their float32 reduce-scatter input, and the root's grads.
    `whole` (shard size 1: `distributed/fsdp.shard_model` does not reshard after forward): every block's."""
    fwd = (spec.numel if whole else spec.root_numel() + 2 * spec.block_numel()) * b
    if not train:
        return fwd
    # The root's grads wait unsharded (compute dtype) with their float32 reduce-scatter input until the
    # end of backward: with a 150k vocabulary that is the largest single buffer of a small model.
    return fwd + spec.block_numel(trainable=True) * (b + 4) + spec.root_numel(trainable=True) * (b + 4)


def _model_items(name: str, spec: ModelSpec, x: PlanInputs, *, active: str, phase: str) -> list[Item]:
    """The items of model `name` in `phase`; `active` = "" (idle), "pass" or "train"."""
    s, b = shard_bytes(spec.params, x.shard_ranks, param_bytes=spec.param_bytes, frozen_bytes=spec.frozen_param_bytes,
                       optimizer=x.optimizer), x.compute_bytes
    out = []
    target = getattr(x.offload, name) if name in OFFLOADABLE else "none"
    idle_off = target if not active and frees_device(target, x.device) else ""
    out.append(Item(name, params_label(spec), s.params, idle_off))
    if name in ("actor", "critic"):
        trains = active == "train"
        optim_off = ""
        if name == "actor" and phase in ("sync", "rollout") and frees_device(x.offload.actor_optim, x.device):
            optim_off = x.offload.actor_optim
        if name == "critic" and not trains and frees_device(target, x.device):
            optim_off = target
        out.append(Item(name, OPTIMIZERS[x.optimizer].label, s.optim, optim_off))
        if trains:
            out.append(Item(name, "grads (fp32 shard)", s.grads))
    if active:
        out.append(Item(name, f"compute copies ({dtype_label(b)})", _copies(spec, b, train=active == "train", whole=x.shard_ranks == 1)))
        out.append(_activations(name, spec, x, train=active == "train"))
    return out


def params_label(spec: ModelSpec) -> str:
    if spec.frozen_param_bytes not in (None, spec.param_bytes):
        return f"params ({dtype_label(spec.frozen_param_bytes)} base + {dtype_label(spec.param_bytes)} adapters, shard)"
    return f"params ({dtype_label(spec.param_bytes)} shard)"


def _activations(name: str, spec: ModelSpec, x: PlanInputs, *, train: bool) -> Item:
    b, d = x.compute_bytes, spec.dims
    if train:
        ckpt = x.activation_checkpointing and name in ("actor", "critic")  # build.py checkpoints both
        a = train_activations(d, x.update_tokens, b=b, attention=x.attention, checkpointing=ckpt, head=spec.head,
                              entropy=x.entropy, responses=x.update_responses, math_len=x.math_len,
                              extra_rows=x.extra_rows(x.update_tokens))
        # LoRA: each adapted linear also keeps its [T, rank] down-projection for lora_B's backward.
        extra = 0 if ckpt else d.num_layers * spec.lora_targets * x.update_tokens * spec.lora_rank * b
        what = f"activations, {x.update_tokens} tok{' (ckpt)' if ckpt else ''}"
        return Item(name, what, a.total + extra)
    else:
        a = forward_activations(d, x.pass_tokens, b=b, attention=x.attention, head=spec.head,
                                responses=x.pass_responses, extra_rows=x.extra_rows(x.pass_tokens))
        what = f"activations, {x.pass_tokens} tok (no grad)"
    return Item(name, what, a.total)


def dtype_label(b: int) -> str:
    return {2: "16-bit", 4: "fp32"}[b]


def process_items(x: PlanInputs, phase: str) -> list[Item]:
    """The rank's process itself: on CPU its host memory before any model (and vLLM's import once started),
    on CUDA the context and NCCL buffers."""
    if x.device.kind == "cuda":
        items = [Item("process", "CUDA context and kernels (typical)", CUDA_CONTEXT_BYTES),
                 Item("process", f"NCCL: {nccl_communicators(x)} communicators (typical)", nccl_bytes(x))]
        if p2p := nccl_p2p_bytes(x.world):
            items.append(Item("process", f"NCCL p2p, {x.world - 1} peers (typical)", p2p))
        return items
    vllm = x.rollout.enabled and phase != "startup"
    what = "python, torch, transformers" + (", vllm" if vllm else "")
    items = [Item("process", what, CPU_PROCESS_BYTES + (CPU_VLLM_IMPORT_BYTES if vllm else 0))]
    if phase != "startup" and (shm := shm_collective_bytes(x)):
        items.append(Item("process", "FSDP's all-gathers and reduce-scatters in shared memory", shm))
    return items


def shm_collective_bytes(x: PlanInputs) -> int:
    """What `distributed/shm_comms` maps on a CPU rank once the first pass has run, as its resident memory counts
    it (shared pages count in every process that touches them): the all-gathers' `AG_SLOTS` buffers of the largest
    block of any sharded model, in its compute dtype, which the rank reads whole; its own reduce-scatter input (the
    largest trained block's float32 gradients) and its chunk of every other rank's. The root unit keeps gloo's
    exchanges (its buffers are among the compute copies)."""
    if x.device.kind != "cpu" or not x.shm_collectives or x.world == 1 or x.shard_ranks == 1:
        return 0
    specs = [s for s in (x.actor, x.reference, x.critic, x.reward_model, x.teacher) if s is not None]
    gathered = max(s.block_numel() for s in specs) * x.compute_bytes  # every model's param_dtype
    trained = [s for s in (x.actor, x.critic) if s is not None]
    grads = max(s.block_numel(trainable=True) for s in trained) * 4
    w = x.shard_ranks
    return AG_SLOTS * gathered + grads + grads * (w - 1) // w


def nccl_communicators(x: PlanInputs) -> int:
    """NCCL communicators a rank holds (see `NCCL_COMMUNICATOR_BYTES`): none in a world of one."""
    trainer = 2 if x.world > 1 else 0
    return trainer + (2 if x.rollout.enabled and x.rollout.tp > 1 else 0)


def nccl_p2p_bytes(world: int) -> int:
    """The all-to-all's point-to-point connections of one rank (`NCCL_P2P_PER_PEER_BYTES` per peer), made in the
    first weight sync: after vLLM's share is measured, so the share keeps room for them (`vllm_memory.measured_share`)."""
    return max(world - 1, 0) * NCCL_P2P_PER_PEER_BYTES


def nccl_bytes(x: PlanInputs) -> int:
    custom = VLLM_CUSTOM_ALLREDUCE_BYTES if x.rollout.enabled and x.rollout.tp > 1 else 0
    return nccl_communicators(x) * NCCL_COMMUNICATOR_BYTES + custom


def host_offload_bytes(x: PlanInputs) -> dict[str, int]:
    """Host memory of `offload.*=cpu` from a GPU, per component: one flat pinned buffer each, exactly the size
    of what it moves (`distributed/offload.py`), registered once and kept for the run."""
    if x.device.kind != "cuda":
        return {}
    o, out = x.offload, {}
    actor = shard_bytes(x.actor.params, x.shard_ranks, param_bytes=x.actor.param_bytes,
                        frozen_bytes=x.actor.frozen_param_bytes)
    if o.actor_params == "cpu":
        out["actor params"] = actor.params
    if o.actor_optim == "cpu":
        out["actor AdamW"] = actor.optim
    for name in OFFLOADABLE:
        spec = getattr(x, name)
        if spec is not None and getattr(o, name) == "cpu":
            b = shard_bytes(spec.params, x.shard_ranks, param_bytes=spec.param_bytes, frozen_bytes=spec.frozen_param_bytes)
            out[name] = b.params
            if name == "critic":
                out["critic AdamW"] = b.optim
    return out


def cuda_resident_overhead_bytes(x: PlanInputs) -> int:
    """What the plan counts in the rollout phase beside the models and vLLM's share: the process's CUDA
    context and communicators (what a fake-CUDA ledger must hold too: tests/unit/engine/test_memory_ledger.py)."""
    return sum(i.on_device for i in process_items(x, "rollout"))


def trainer_items(x: PlanInputs, name: str, *, first_step: bool = False) -> list[Item]:
    active = {"old_logp": ("actor", "pass"), "update": ("actor", "train"), "critic_update": ("critic", "train"),
              "reference": ("actor" if x.reference_from_actor else "reference", "pass"), "critic": ("critic", "pass"),
              "reward_model": ("reward_model", "pass"), "teacher": ("teacher", "pass")}.get(name, ("", ""))
    items: list[Item] = []
    for comp in ("actor", *OFFLOADABLE):
        spec = getattr(x, comp)
        if spec is None:
            continue
        mode = active[1] if active[0] == comp else ""
        got = _model_items(comp, spec, x, active=mode, phase=name)
        if comp == "actor" and name == "rollout" and frees_device(x.offload.actor_params, x.device):
            got[0] = dataclasses.replace(got[0], offloaded=x.offload.actor_params)
        if first_step:  # before its first pass a model has never been offloaded
            got = [dataclasses.replace(i, offloaded="") if i.component in OFFLOADABLE else i for i in got]
        items += got
    return items
