"""What vLLM holds on a trainer rank (colocated): its weights, KV cache and runtime, its share of a GPU, and
what the weight sync needs while it streams the weights in."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from hybrid_rl.planner.inputs import ModelSpec, PlanInputs
from hybrid_rl.planner.result import Item, safety_margin_bytes
from hybrid_rl.planner.trainer_memory import dtype_label, nccl_p2p_bytes, process_items, trainer_items
from hybrid_rl.planner.units import GIB

# What a started vLLM adds on CPU beyond its weights and KV cache (CPU kernels' workspace and packed-weight overhead,
# sampler); its import is counted with the process (`trainer_memory.CPU_VLLM_IMPORT_BYTES`). Fitted to vLLM built
# alone on this project's 2-core machine (`benchmarks/scale.py`'s models): runtime 0.22 GiB for a 462-token
# vocabulary, 0.75 / 0.91 / 0.99 GiB for Qwen2.5-0.5B / 1.5B / 3B shapes (151,936 tokens): a constant, a part that
# grows with the vocabulary, and a small share of the weights.
CPU_VLLM_RUNTIME_BYTES = int(0.22 * GIB)
CPU_VLLM_RUNTIME_PER_VOCAB = int(0.49 * GIB / 151936)
CPU_VLLM_RUNTIME_PER_WEIGHT_BYTE = 0.046
# What vLLM keeps on the GPU while asleep (sleep mode frees only its weights and KV cache): the CUDA-graph pool
# (vLLM logs "CUDA graph pool memory: N GiB (actual)" at start; typically 0.3-1 GiB for 7B-32B decoders with its
# default capture sizes) and the model runner's persistent input buffers.
VLLM_GRAPH_POOL_BYTES = int(0.75 * GIB)
VLLM_MAX_BATCHED_TOKENS = 8192  # vLLM's default token budget per scheduler step: sizes its persistent buffers
MAX_AUTO_UTILIZATION = 0.9  # the most of a GPU `rollout.gpu_memory_utilization=auto` gives vLLM
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before splitting it over TP ranks


def vllm_weight_bytes(spec: ModelSpec, tp: int, dtype_bytes: int) -> int:
    """vLLM's weights on one TP rank: linear layers (and a mixture's experts) split over TP, KV heads replicated
    when fewer than TP, the vocabulary padded to a multiple of 64 and split, norms and MoE routers replicated."""
    d, numel = spec.dims, 0
    kv_rows = max(d.num_kv_heads // tp, 1) * d.head_dim
    for p in spec.params:
        if "lora_" in p.name:  # vLLM gets the merged weights, not the adapter
            continue
        if "embed_tokens" in p.name or "lm_head" in p.name:
            padded = -(-p.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
            numel += -(-padded // tp) * (p.numel // p.shape[0])
        elif "k_proj" in p.name or "v_proj" in p.name:
            numel += kv_rows * (p.numel // p.shape[0])
        elif "norm" in p.name or p.name.endswith("mlp.gate.weight"):
            numel += p.numel
        else:
            numel += -(-p.numel // tp)
    return numel * dtype_bytes


def sync_reserve_bytes(bucket_bytes: int, largest_module_bytes: int = 0) -> int:
    """GPU memory left outside vLLM's share for the weight sync, which runs while vLLM is resident: the
    resharder's peak (`sync_transient_bytes` on CUDA: two buckets in flight plus one module, a bucket never
    smaller than vLLM's largest module; at least three buckets) plus 1 GiB of allocator slack."""
    bucket = max(bucket_bytes, largest_module_bytes)
    return max(3 * bucket_bytes, 2 * bucket + largest_module_bytes) + GIB


def plan_sync_reserve(x: PlanInputs) -> int:
    """What the auto share keeps outside vLLM, in the planner and in the engine (`build.py` passes it): the
    sync's reserve (`sync_reserve_bytes`) and the safety margin every GPU plan keeps free."""
    return sync_reserve_bytes(x.rollout.bucket_bytes, largest_module_bytes(x)) + safety_margin_bytes(x.device)


def auto_gpu_memory_utilization(free_bytes: int, total_bytes: int, reserve_bytes: int) -> float:
    """vLLM's share of the GPU for `rollout.gpu_memory_utilization=0` (auto): the memory free when vLLM
    starts less `reserve_bytes`, as a fraction of the device rounded down to 0.01, at most 0.9 (vLLM's
    own default). Zero or less means vLLM cannot start; callers say so."""
    share = (free_bytes - reserve_bytes) / total_bytes
    return min(MAX_AUTO_UTILIZATION, math.floor(share * 100) / 100)


def measured_share(free_bytes: Iterable[int], total_bytes: int, *, state_to_come: int, world: int,
                   reserve_bytes: int) -> float:
    """vLLM's automatic share from memory measured on the GPUs it will run on, one rule for both deployments (the
    colocated engine, `VLLMEngine.gpu_utilization`; a sidecar on the trainer's GPUs, `build.measured_utilization`):
    the least any of them has free (a TP group runs on several; each must fit the same share), less what the
    trainer does not hold yet but will at every later rollout (`state_to_come`: every optimizer state still to be
    created and not offloaded for rollouts; the all-to-all's point-to-point connections, `nccl_p2p_bytes`, made
    in the first sync), less `reserve_bytes` (`plan_sync_reserve`: the sync's reserve and the safety margin).
    The planner applies the same rule to the memory it predicts (`vllm_utilization`)."""
    later = state_to_come + nccl_p2p_bytes(world)
    return auto_gpu_memory_utilization(min(free_bytes) - later, total_bytes, reserve_bytes)


def vllm_utilization(x: PlanInputs) -> float:
    """vLLM's share of the device: the configured one, or the auto rule applied to the memory the trainer
    is predicted to hold when vLLM first starts (the first sync, before any model was offloaded) with
    AdamW's state counted as resident (unless offloaded for rollouts): it does not exist before the first
    step, but it does at every later rollout, when vLLM's KV cache must wake beside it. The engine applies
    the same rule to the memory it measures (`VLLMEngine.gpu_utilization`, given the state still to come)."""
    r = x.rollout
    if r.gpu_memory_utilization is not None:
        return r.gpu_memory_utilization
    held = sum(i.on_device for i in process_items(x, "sync") + trainer_items(x, "sync", first_step=True))
    total = x.device.total_bytes
    return max(0.0, auto_gpu_memory_utilization(total - held, total, plan_sync_reserve(x)))


def vllm_kept_asleep_bytes(x: PlanInputs) -> int:
    """What vLLM keeps on the GPU through sleep mode (CUDA): its CUDA-graph pool (unless eager) and the model
    runner's persistent buffers (token ids, positions, hidden-size staging for `VLLM_MAX_BATCHED_TOKENS`)."""
    r = x.rollout
    runner = VLLM_MAX_BATCHED_TOKENS * (4 * x.actor.dims.hidden_size * r.dtype_bytes + 64)
    return VLLM_GRAPH_POOL_BYTES + runner


def kv_cache_bytes(x: PlanInputs) -> int:
    """vLLM's KV cache: the configured size, or (CUDA) its share less its weights and what it keeps asleep."""
    r = x.rollout
    if r.kv_cache_bytes is not None:
        return r.kv_cache_bytes
    kept = vllm_kept_asleep_bytes(x) + fused_moe_workspace_bytes(x) if x.device.kind == "cuda" else 0
    return max(0, int(vllm_utilization(x) * x.device.total_bytes) - vllm_weight_bytes(x.actor, r.tp, r.dtype_bytes)
               - kept)


def fused_moe_workspace_bytes(x: PlanInputs) -> int:
    """vLLM's fused-MoE kernel's intermediate buffers for one forward of its token budget (CUDA; 0 elsewhere or
    for a dense model): the Triton path (`fused_moe.fused_experts_impl`) allocates, for M tokens, one buffer of
    `M x top_k x max(2I / tp, H)` for the gate/up output and the down output (reused) and one of `M x top_k x I / tp`
    for the activation, in the model's dtype. vLLM's profile run sizes it for `VLLM_MAX_BATCHED_TOKENS` and takes it
    out of its share before the KV cache."""
    d, r = x.actor.dims, x.rollout
    if x.device.kind != "cuda" or not d.moe_layers:
        return 0
    inter = -(-d.moe_intermediate_size // r.tp)
    pairs = VLLM_MAX_BATCHED_TOKENS * d.top_k
    return pairs * (max(2 * inter, d.hidden_size) + inter) * r.dtype_bytes


def vllm_items(x: PlanInputs, phase: str) -> list[Item]:
    r = x.rollout
    if not r.enabled:
        return []
    released = "" if phase in ("sync", "rollout") or r.release == "keep" else f"released ({r.release})"
    kv_off = released or ("asleep" if phase == "sync" and r.release == "sleep" else "")
    weights = vllm_weight_bytes(x.actor, r.tp, r.dtype_bytes)
    items = [Item("vllm", f"weights ({dtype_label(r.dtype_bytes)}, 1/{r.tp} TP)", weights, released),
             Item("vllm", "KV cache", kv_cache_bytes(x), kv_off)]
    if x.device.kind == "cuda" and r.release != "restart":
        # Inside vLLM's share while it is awake; what stays on the GPU while it sleeps.
        items.append(Item("vllm", "kept asleep: CUDA graphs, runner buffers", vllm_kept_asleep_bytes(x)))
    if workspace := fused_moe_workspace_bytes(x):
        items.append(Item("vllm", "runtime: fused-MoE workspace", workspace, released))
    if x.device.kind == "cpu":  # on CUDA vLLM's workspace is inside its share (gpu_memory_utilization)
        runtime = (CPU_VLLM_RUNTIME_BYTES + CPU_VLLM_RUNTIME_PER_VOCAB * x.actor.dims.vocab_size
                   + int(CPU_VLLM_RUNTIME_PER_WEIGHT_BYTE * weights))
        items.append(Item("vllm", "runtime (CPU kernels' workspace, sampler)", runtime, released))
    if r.lora_adapter:
        items.append(Item("vllm", "LoRA adapter (slot + host copy)", lora_adapter_bytes(x.actor, r.dtype_bytes),
                          released))
    if phase == "sync":
        items.append(Item("vllm", "weight sync in flight", sync_transient_bytes(x)))
        if merge := lora_merge_bytes(x):
            items.append(Item("actor", "LoRA merge of the largest adapted layer (float32)", merge))
    return items


_FUSED = re.compile(r"\.(q|k|v)_proj\.(weight|bias)$|\.(gate|up)_proj\.weight$")


def _vllm_module(name: str) -> str:
    """The vLLM module an HF weight lands in (`weightsync/layout.py`: q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    m = _FUSED.search(name)
    if m is None:
        return name.rsplit(".", 1)[0]
    return name[: m.start()] + (".qkv_proj" if m.group(1) else ".gate_up_proj")


def largest_module_bytes(x: PlanInputs) -> int:
    """vLLM's largest module on one TP rank (fused parts together: the resharder never splits one over buckets)."""
    r, sizes = x.rollout, {}
    for p in x.actor.params:
        if "lora_" not in p.name:
            key = _vllm_module(p.name)
            sizes[key] = sizes.get(key, 0) + vllm_weight_bytes(ModelSpec((p,), x.actor.dims), r.tp, r.dtype_bytes)
    return max(sizes.values(), default=0)


def vllm_host_bytes(x: PlanInputs) -> dict[str, int]:
    """Host memory vLLM holds per rank (CUDA), beside the offload buffers (`trainer_memory.host_offload_bytes`).

    A LoRA actor sleeps vLLM at level 1 (`colocated/hybrid.py`: only the adapted weights change, so the rest stays
    and is not sent again): vLLM's sleep-mode allocator backs every weight allocation up in a pinned host tensor,
    which torch's pinned allocator rounds up to a power of two and keeps cached after the wake-up, so it is held
    for the run. Counted per vLLM weight tensor on this rank (fused q/k/v and gate/up are one tensor each)."""
    r = x.rollout
    if x.device.kind != "cuda" or not r.enabled or r.release != "sleep" or not x.actor.lora_rank:
        return {}
    sizes: dict[str, int] = {}
    for p in x.actor.params:
        if "lora_" not in p.name:
            name = p.name.replace(".base_layer.", ".")
            key = f"{_vllm_module(name)}.{name.rsplit('.', 1)[1]}"
            sizes[key] = sizes.get(key, 0) + vllm_weight_bytes(ModelSpec((p,), x.actor.dims), r.tp, r.dtype_bytes)
    return {"vLLM weights backed up by sleep level 1 (pinned, powers of two)":
            sum(1 << (n - 1).bit_length() for n in sizes.values() if n)}


def lora_adapter_bytes(spec: ModelSpec, dtype_bytes: int) -> int:
    """vLLM's memory for one adapter (`max_loras=1`, `max_cpu_loras=1`): its LoRA slot, sized for the rank vLLM
    rounds up to, and the adapter as loaded from the folder. Counted whole on every TP rank (an upper bound: vLLM
    slices one of A and B of each layer)."""
    if not spec.lora_rank:
        return 0
    slot = next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= spec.lora_rank)  # vLLM's max_lora_rank
    numel = sum(p.numel for p in spec.params if "lora_" in p.name)
    return numel * dtype_bytes * (spec.lora_rank + slot) // spec.lora_rank


def lora_merge_bytes(x: PlanInputs) -> int:
    """Merged LoRA sync (`model.lora.sync=merged`): each adapted weight is sent as `W + scaling * B @ A`, computed on
    each rank for the rows it holds (`model/lora.py:_merged_shard`): float32 copies of W's rows, of B @ A and of
    their sum are alive at once, for one layer at a time (the largest counts); a mixture's adapted fused experts
    (`_merged_expert_shard`) the same way, for the experts the rank holds (a fused tensor in a module peft wrapped:
    an upper bound where only one of a module's two is adapted). Adapter sync merges nothing."""
    s = x.actor
    if not s.lora_rank or x.rollout.lora_adapter:
        return 0
    adapted = {p.name.replace(".lora_B.default.weight", ".base_layer.weight") for p in s.params
               if p.name.endswith(".lora_B.default.weight")}
    largest = max((p.numel for p in s.params
                   if p.name in adapted or (len(p.shape) == 3 and ".base_layer." in p.name)), default=0)
    return 3 * 4 * -(-largest // x.shard_ranks)


def sync_transient_bytes(x: PlanInputs) -> int:
    """Extra memory while the weights stream into vLLM (`weightsync/reshard.py`, `weightsync/vllm_weights.py`).

    A bucket holds at least its largest vLLM module. While a bucket moves, its send and receive buffers are
    alive (2 buckets); then the received buffer and the assembled slices (2 buckets); the consumer still
    holds the previous bucket's last slice when the next one starts (1 module). The in-place path (CUDA:
    vLLM's own parameter classes, tests/unit/weightsync/test_inplace_vllm_layers.py) copies each slice straight
    into vLLM's parameter, so nothing else is alive. On the CPU reload path vLLM's loader also holds its
    own copies of the module it is processing (2 x the largest: the original layout it rebuilds and the
    repacked result) beside the staged full-shape tensor.

    An upper bound where the landing takes rows (`row_landing`: the in-place and packed paths): there the received
    pieces go to vLLM unassembled, and at world 1 no buffer is made at all (the slices are the trainer's weights).
    """
    r = x.rollout
    largest = largest_module_bytes(x)
    bucket = min(max(r.bucket_bytes, largest), vllm_weight_bytes(x.actor, r.tp, r.dtype_bytes))
    if x.device.kind == "cuda":
        return 2 * bucket + largest
    return max(2 * bucket, bucket + 2 * largest)
