"""Expected memory per rank in each phase of an RL step: numbers in, a `MemoryPlan` out. Pure arithmetic.

Who holds what, as `build.py`, `colocated/hybrid.py` and `trainer.py` arrange it:

* Every model is FSDP2-sharded: trained ones with float32 master weights, frozen ones (reference,
  reward model) in `model.frozen_dtype` (`ModelSpec.param_bytes`); FSDP2 pads dim 0 of
  each parameter to a multiple of the world size, so a rank holds `ceil(dim0 / W)` rows of each
  (storage), while AdamW's moments are `zeros_like` of the *unpadded* local shard (rank 0 holds the
  most). Gradients exist only between the first backward and `zero_grad(set_to_none=True)`.
* A pass all-gathers one block at a time in `model.dtype` (plus the prefetched next one); the root
  (embeddings, final norm, head) stays unsharded from forward to the end of backward, and backward
  holds one block's unsharded grads plus their float32 reduce-scatter input.
* Rollout: the optimizer state (and, after the weight sync, the actor's params) go to
  `offload.actor_optim` / `offload.actor_params`; vLLM holds its weights (rollout dtype, 1/TP, vocab
  padded to 64) and the KV cache. In train mode vLLM is released (`sleep`, `restart`) or stays
  (`keep`, the CPU default).
* Reference, critic and reward model go to `offload.<name>` after their pass and come back for it.
  The critic's optimizer state goes with it after its update and comes back only for the next one
  (and to be saved). On a CPU-only device `cpu` offload frees nothing (the bytes move to other host
  buffers).

* Start-up: `build.py` builds each model on the meta device and each rank reads only its own rows
  of the checkpoint into its shards, a block of at most `load_chunk_bytes` at a time; nothing else
  exists yet (AdamW's states come with the first step, vLLM with the first weight sync).

Phases (the trainer's timer names, plus `startup`, `sync` and `critic_update`): startup, sync,
rollout, old_logp, reference, critic, reward_model, teacher, update, critic_update.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from hybrid_rl.model.activations import MATH_MAX_LEN, Attention, forward_activations, train_activations
from hybrid_rl.model.optimizers import OPTIMIZERS
from hybrid_rl.model.param_count import ArchDims, Head, ParamShape

GIB = 2**30
# Host memory of a rank's process before any model (CPU plans count RSS): python, torch and transformers,
# and what importing and starting vLLM adds beyond its weights and KV cache (CPU kernels' workspace and
# packed-weight overhead, sampler). Fitted to vLLM built alone on this project's 2-core machine
# (`benchmarks/scale.py`'s models): runtime 0.22 GiB for a 462-token vocabulary, 0.75 / 0.91 / 0.99 GiB for
# Qwen2.5-0.5B / 1.5B / 3B shapes (151,936 tokens): a constant, a part that grows with the vocabulary, and a
# small share of the weights.
CPU_PROCESS_BYTES = int(0.43 * GIB)
CPU_VLLM_IMPORT_BYTES = int(0.18 * GIB)
CPU_VLLM_RUNTIME_BYTES = int(0.22 * GIB)
CPU_VLLM_RUNTIME_PER_VOCAB = int(0.49 * GIB / 151936)
CPU_VLLM_RUNTIME_PER_WEIGHT_BYTE = 0.046
# CUDA figures no CPU can measure (nor did the project's one GPU run, tests/gpu, which read PyTorch's allocations only):
# typical values, stated so a user can check them against a run's own log (vLLM logs its graph pool; `nvidia-smi`
# shows the context) and adjust the margin.
CUDA_CONTEXT_BYTES = int(0.6 * GIB)  # CUDA context + torch's and NCCL's kernels (CUDA 12 lazy loading), per GPU
# One NCCL communicator on an NVLink node: NCCL_BUFFSIZE (4 MiB) x send/recv x up to 32 channels, plus its
# proxy and work FIFOs. A rank joins: the trainer's world group (FSDP's collectives) and its point-to-point
# channels (the resharder's all-to-all); with rollout.tp > 1 vLLM's TP group twice (its PyNccl communicator and
# torch's group), plus vLLM's custom all-reduce IPC buffers.
NCCL_COMMUNICATOR_BYTES = int(0.3 * GIB)
VLLM_CUSTOM_ALLREDUCE_BYTES = 64 * 2**20
# What vLLM keeps on the GPU while asleep (sleep mode frees only its weights and KV cache): the CUDA-graph pool
# (vLLM logs "CUDA graph pool memory: N GiB (actual)" at start; typically 0.3-1 GiB for 7B-32B decoders with its
# default capture sizes) and the model runner's persistent input buffers.
VLLM_GRAPH_POOL_BYTES = int(0.75 * GIB)
VLLM_MAX_BATCHED_TOKENS = 8192  # vLLM's default token budget per scheduler step: sizes its persistent buffers
FRAGMENTATION = 0.05  # torch's caching allocator: share of the trainer's allocations lost to fragmentation
SAFETY_MARGIN = 0.05  # of a GPU: kept free beyond every counted item (a plan with less than this does not fit)
MAX_AUTO_UTILIZATION = 0.9  # the most of a GPU `rollout.gpu_memory_utilization=auto` gives vLLM
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before splitting it over TP ranks
# Offloaded after their pass / update (`offload.<name>`).
OFFLOADABLE = ("reference", "critic", "reward_model", "teacher")


@dataclass(frozen=True)
class ModelSpec:
    """One model as the planner sees it: every parameter shape, the activation dims and the head."""

    params: tuple[ParamShape, ...]
    dims: ArchDims
    head: Head = "lm"
    lora_rank: int = 0  # > 0: a peft LoRA model (only the adapters train)
    lora_targets: int = 0  # adapted linear layers per block
    param_bytes: int = 4  # stored shards: float32 master weights (trained), model.frozen_dtype (frozen)
    frozen_param_bytes: int | None = None  # LoRA: the frozen base's storage (model.frozen_dtype); None = param_bytes

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def block_numel(self, *, trainable: bool = False) -> int:
        """The largest transformer block (one FSDP unit); `trainable`: only what gets gradients."""
        sizes: dict[int, int] = {}
        for p in self.params:
            if p.block is not None and (p.trainable or not trainable):
                sizes[p.block] = sizes.get(p.block, 0) + p.numel
        return max(sizes.values(), default=0)

    def root_numel(self, *, trainable: bool = False) -> int:
        """Parameters outside the blocks: embeddings, final norm, head (the root FSDP unit)."""
        return sum(p.numel for p in self.params if p.block is None and (p.trainable or not trainable))


@dataclass(frozen=True)
class ShardBytes:
    """Bytes one rank holds for one model under FSDP2 (world 1 = the plain model)."""

    params: int  # stored shards (float32 master weights unless frozen), dim 0 padded to a multiple of the world
    grads: int  # float32, padded like the params (views into FSDP's reduce-scatter output); trainable only
    optim: int  # the moments of the unpadded local shard (`model/optimizers.py`) + a float32 `step` per trainable tensor


def shard_rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """(padded rows, real rows) of FSDP2's Shard(0) for `rank`: chunks of ceil(dim0 / world)."""
    chunk = -(-dim0 // world)
    return chunk, max(0, min(chunk, dim0 - rank * chunk))


def shard_bytes(params: tuple[ParamShape, ...] | list[ParamShape], world: int, rank: int = 0, *,
                param_bytes: int = 4, frozen_bytes: int | None = None, optimizer: str = "adamw") -> ShardBytes:
    """`frozen_bytes`: storage of the parameters that do not train (a LoRA base); None = `param_bytes`.
    `optimizer`: an `optim.name`; its state is counted per trainable tensor (8-bit moments depend on each size)."""
    state_bytes = OPTIMIZERS[optimizer].state_bytes
    stored = trained_padded = moments = 0
    for p in params:
        dim0 = p.shape[0] if p.shape else 1
        rest = p.numel // dim0 if dim0 else 0
        pad_rows, real_rows = shard_rows(dim0, world, rank)
        stored += pad_rows * rest * (param_bytes if p.trainable or frozen_bytes is None else frozen_bytes)
        if p.trainable:
            trained_padded += pad_rows * rest
            moments += state_bytes(real_rows * rest)
    steps = sum(p.trainable for p in params)
    return ShardBytes(params=stored, grads=4 * trained_padded, optim=moments + 4 * steps)


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # cuda | cpu
    total_bytes: int  # per rank: a GPU's memory, or the host memory available when planning / local ranks
    name: str = ""


@dataclass(frozen=True)
class RolloutSpec:
    enabled: bool  # False: offline DPO without validation never starts vLLM
    tp: int = 1
    dtype_bytes: int = 2
    kv_cache_bytes: int | None = None  # None: gpu_memory_utilization x device - weights (CUDA)
    gpu_memory_utilization: float | None = None  # None: auto (`vllm_utilization`)
    release: str = "sleep"  # keep | sleep | restart (resolved, never "auto")
    bucket_bytes: int = 256 * 2**20
    max_model_len: int = 0  # the longest sequence vLLM must hold (0 = not checked)
    lora_adapter: bool = False  # model.lora.sync=adapter: vLLM serves the adapter itself (else merged weights)


@dataclass(frozen=True)
class OffloadSpec:
    actor_params: str = "none"
    actor_grads: str = "none"
    actor_optim: str = "none"
    reference: str = "none"
    critic: str = "none"
    reward_model: str = "none"
    teacher: str = "none"


@dataclass(frozen=True)
class PlanInputs:
    actor: ModelSpec
    world: int
    device: DeviceSpec
    compute_bytes: int  # model.dtype: FSDP's compute copies and activations
    pass_tokens: int  # tokens of one no-grad micro-batch (old log-probs, reference, critic, reward model)
    update_tokens: int  # tokens of one training micro-batch
    micro_batch_tokens: int  # trainer.micro_batch_tokens (the budget the two above come from)
    max_sequence_tokens: int  # the longest sample: a micro-batch never holds less than one
    rollout: RolloutSpec
    pass_responses: int | None = None  # response tokens among pass_tokens (None: all of them, an upper bound)
    update_responses: int | None = None  # response tokens among update_tokens
    offload: OffloadSpec = OffloadSpec()
    reference: ModelSpec | None = None
    critic: ModelSpec | None = None
    reward_model: ModelSpec | None = None
    teacher: ModelSpec | None = None  # on-policy distillation's frozen teacher
    reference_from_actor: bool = False  # LoRA: the reference pass is the actor with its adapter disabled
    activation_checkpointing: bool = False
    attention: Attention = "sdpa"
    entropy: bool = True  # the PPO-clip objective computes token entropies in the update
    old_logp_pass: bool = True  # False: the update's own forward gives the old log-probs
    load_chunk_bytes: int = 8 * 2**20  # model/materialize.READ_CHUNK_BYTES: the largest single checkpoint read
    optimizer: str = "adamw"  # optim.name: the actor's and the critic's

    @property
    def math_len(self) -> int:
        """Sequences up to this long run SDPA's math kernel in the update (CPU; 0: none do)."""
        return min(self.max_sequence_tokens, MATH_MAX_LEN) if self.device.kind == "cpu" and self.attention == "sdpa" else 0


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

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def memory(self, component: str, rank: int = 0) -> ShardBytes:
        """Exact per-rank params / grads / optimizer bytes of one model."""
        spec = getattr(self.inputs, component)
        return shard_bytes(spec.params, self.inputs.world, rank, param_bytes=spec.param_bytes,
                           frozen_bytes=spec.frozen_param_bytes, optimizer=self.inputs.optimizer)

    def table(self, measured: dict[str, float] | None = None) -> str:
        """The plan as text; `measured` (phase -> peak GiB) adds a row beside the prediction."""
        from hybrid_rl.model.memory_table import render

        return render(self, measured)

    def verdict(self) -> str:
        from hybrid_rl.model.memory_table import verdict

        return verdict(self)


# ---------------------------------------------------------------------------------------------
# Estimation


def safety_margin_bytes(device: DeviceSpec) -> int:
    return int(SAFETY_MARGIN * device.total_bytes) if device.kind == "cuda" else 0


def frees_device(target: str, device: DeviceSpec) -> bool:
    """Does offloading to `target` free device memory? `cpu` on a CPU-only device is a no-op."""
    return target == "disk" or (target == "cpu" and device.kind == "cuda")


def vllm_weight_bytes(spec: ModelSpec, tp: int, dtype_bytes: int) -> int:
    """vLLM's weights on one TP rank: linear layers split over TP, KV heads replicated when
    fewer than TP, the vocabulary padded to a multiple of 64 and split, norms replicated."""
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
        elif "norm" in p.name:
            numel += p.numel
        else:
            numel += -(-p.numel // tp)
    return numel * dtype_bytes


def _copies(spec: ModelSpec, b: int, *, train: bool) -> int:
    """FSDP's unsharded compute copies: the root, the running block and the prefetched one; in
    backward also one block's unsharded grads, their float32 reduce-scatter input, and the root's grads."""
    fwd = (spec.root_numel() + 2 * spec.block_numel()) * b
    if not train:
        return fwd
    # The root's grads wait unsharded (compute dtype) with their float32 reduce-scatter input until the
    # end of backward: with a 150k vocabulary that is the largest single buffer of a small model.
    return fwd + spec.block_numel(trainable=True) * (b + 4) + spec.root_numel(trainable=True) * (b + 4)


def _model_items(name: str, spec: ModelSpec, x: PlanInputs, *, active: str, phase: str) -> list[Item]:
    """The items of model `name` in `phase`; `active` = "" (idle), "pass" or "train"."""
    s, b = shard_bytes(spec.params, x.world, param_bytes=spec.param_bytes, frozen_bytes=spec.frozen_param_bytes,
                       optimizer=x.optimizer), x.compute_bytes
    out = []
    target = getattr(x.offload, name) if name in OFFLOADABLE else "none"
    idle_off = target if not active and frees_device(target, x.device) else ""
    out.append(Item(name, _params_label(spec), s.params, idle_off))
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
        out.append(Item(name, f"compute copies ({_dtype(b)})", _copies(spec, b, train=active == "train")))
        out.append(_activations(name, spec, x, train=active == "train"))
    return out


def _params_label(spec: ModelSpec) -> str:
    if spec.frozen_param_bytes not in (None, spec.param_bytes):
        return f"params ({_dtype(spec.frozen_param_bytes)} base + {_dtype(spec.param_bytes)} adapters, shard)"
    return f"params ({_dtype(spec.param_bytes)} shard)"


def _startup(x: PlanInputs) -> Phase:
    """While `build.py` loads the models: every model's shards, and one checkpoint read in flight (the
    block of rows and the file pages it maps)."""
    items, largest = [], 0
    for comp in ("actor", *OFFLOADABLE):
        spec = getattr(x, comp)
        if spec is None:
            continue
        items.append(Item(comp, _params_label(spec), shard_bytes(spec.params, x.world,
                                                                  param_bytes=spec.param_bytes,
                                                                  frozen_bytes=spec.frozen_param_bytes).params))
        largest = max([largest] + [shard_rows(p.shape[0], x.world, 0)[0] * (p.numel // p.shape[0]) * 4
                                   for p in spec.params if p.shape])
    items.append(Item("loading", "checkpoint read (rows + mapped pages)", 2 * min(x.load_chunk_bytes, largest)))
    return Phase("startup", tuple(_process_items(x, "startup") + items))


def _activations(name: str, spec: ModelSpec, x: PlanInputs, *, train: bool) -> Item:
    b, d = x.compute_bytes, spec.dims
    if train:
        ckpt = x.activation_checkpointing and name in ("actor", "critic")  # build.py checkpoints both
        a = train_activations(d, x.update_tokens, b=b, attention=x.attention, checkpointing=ckpt, head=spec.head,
                              entropy=x.entropy, responses=x.update_responses, math_len=x.math_len)
        # LoRA: each adapted linear also keeps its [T, rank] down-projection for lora_B's backward.
        extra = 0 if ckpt else d.num_layers * spec.lora_targets * x.update_tokens * spec.lora_rank * b
        what = f"activations, {x.update_tokens} tok{' (ckpt)' if ckpt else ''}"
        return Item(name, what, a.total + extra)
    else:
        a = forward_activations(d, x.pass_tokens, b=b, attention=x.attention, head=spec.head,
                                responses=x.pass_responses)
        what = f"activations, {x.pass_tokens} tok (no grad)"
    return Item(name, what, a.total)


def _dtype(b: int) -> str:
    return {2: "16-bit", 4: "fp32"}[b]


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


def vllm_utilization(x: PlanInputs) -> float:
    """vLLM's share of the device: the configured one, or the auto rule applied to the memory the trainer
    is predicted to hold when vLLM first starts (the first sync, before any model was offloaded) with
    AdamW's state counted as resident (unless offloaded for rollouts): it does not exist before the first
    step, but it does at every later rollout, when vLLM's KV cache must wake beside it. The engine applies
    the same rule to the memory it measures (`VLLMEngine.gpu_utilization`, given the state still to come)."""
    r = x.rollout
    if r.gpu_memory_utilization is not None:
        return r.gpu_memory_utilization
    held = sum(i.on_device for i in _process_items(x, "sync") + _trainer_items(x, "sync", first_step=True))
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
    kept = vllm_kept_asleep_bytes(x) if x.device.kind == "cuda" else 0
    return max(0, int(vllm_utilization(x) * x.device.total_bytes) - vllm_weight_bytes(x.actor, r.tp, r.dtype_bytes)
               - kept)


def _vllm_items(x: PlanInputs, phase: str) -> list[Item]:
    r = x.rollout
    if not r.enabled:
        return []
    released = "" if phase in ("sync", "rollout") or r.release == "keep" else f"released ({r.release})"
    kv_off = released or ("asleep" if phase == "sync" and r.release == "sleep" else "")
    weights = vllm_weight_bytes(x.actor, r.tp, r.dtype_bytes)
    items = [Item("vllm", f"weights ({_dtype(r.dtype_bytes)}, 1/{r.tp} TP)", weights, released),
             Item("vllm", "KV cache", kv_cache_bytes(x), kv_off)]
    if x.device.kind == "cuda" and r.release != "restart":
        # Inside vLLM's share while it is awake; what stays on the GPU while it sleeps.
        items.append(Item("vllm", "kept asleep: CUDA graphs, runner buffers", vllm_kept_asleep_bytes(x)))
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
    their sum are alive at once, for one layer at a time (the largest counts). Adapter sync merges nothing."""
    s = x.actor
    if not s.lora_rank or x.rollout.lora_adapter:
        return 0
    adapted = {p.name.replace(".lora_B.default.weight", ".base_layer.weight") for p in s.params
               if p.name.endswith(".lora_B.default.weight")}
    largest = max((p.numel for p in s.params if p.name in adapted), default=0)
    return 3 * 4 * -(-largest // x.world)


def sync_transient_bytes(x: PlanInputs) -> int:
    """Extra memory while the weights stream into vLLM (`weightsync/reshard.py`, `weightsync/vllm_weights.py`).

    A bucket holds at least its largest vLLM module. While a bucket moves, its send and receive buffers are
    alive (2 buckets); then the received buffer and the assembled slices (2 buckets); the consumer still
    holds the previous bucket's last slice when the next one starts (1 module). The in-place path (CUDA:
    vLLM's own parameter classes, tests/unit/engine/test_inplace_vllm_layers.py) copies each slice straight
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


def _process_items(x: PlanInputs, phase: str) -> list[Item]:
    """The rank's process itself: on CPU its host memory before any model (and vLLM's import once started),
    on CUDA the context and NCCL buffers."""
    if x.device.kind == "cuda":
        return [Item("process", "CUDA context and kernels (typical)", CUDA_CONTEXT_BYTES),
                Item("process", f"NCCL: {nccl_communicators(x)} communicators (typical)", nccl_bytes(x))]
    vllm = x.rollout.enabled and phase != "startup"
    what = "python, torch, transformers" + (", vllm" if vllm else "")
    return [Item("process", what, CPU_PROCESS_BYTES + (CPU_VLLM_IMPORT_BYTES if vllm else 0))]


def nccl_communicators(x: PlanInputs) -> int:
    """NCCL communicators a rank holds (see `NCCL_COMMUNICATOR_BYTES`): none in a world of one."""
    trainer = 2 if x.world > 1 else 0
    return trainer + (2 if x.rollout.enabled and x.rollout.tp > 1 else 0)


def nccl_bytes(x: PlanInputs) -> int:
    custom = VLLM_CUSTOM_ALLREDUCE_BYTES if x.rollout.enabled and x.rollout.tp > 1 else 0
    return nccl_communicators(x) * NCCL_COMMUNICATOR_BYTES + custom


def _fragmentation(items: list[Item]) -> list[Item]:
    """torch's caching allocator keeps partly used segments of the trainer's churn (activations, compute copies)."""
    churn = sum(i.on_device for i in items if i.component not in ("process", "vllm"))
    return [Item("allocator", f"fragmentation ({FRAGMENTATION:.0%} of the trainer's)", int(FRAGMENTATION * churn))]


def host_offload_bytes(x: PlanInputs) -> dict[str, int]:
    """Host memory of `offload.*=cpu` from a GPU, per component: one flat pinned buffer each, exactly the size
    of what it moves (`distributed/offload.py`), registered once and kept for the run."""
    if x.device.kind != "cuda":
        return {}
    o, out = x.offload, {}
    actor = shard_bytes(x.actor.params, x.world, param_bytes=x.actor.param_bytes,
                        frozen_bytes=x.actor.frozen_param_bytes)
    if o.actor_params == "cpu":
        out["actor params"] = actor.params
    if o.actor_optim == "cpu":
        out["actor AdamW"] = actor.optim
    for name in OFFLOADABLE:
        spec = getattr(x, name)
        if spec is not None and getattr(o, name) == "cpu":
            b = shard_bytes(spec.params, x.world, param_bytes=spec.param_bytes, frozen_bytes=spec.frozen_param_bytes)
            out[name] = b.params
            if name == "critic":
                out["critic AdamW"] = b.optim
    return out


def cuda_resident_overhead_bytes(x: PlanInputs) -> int:
    """What the plan counts in the rollout phase beside the models and vLLM's share: the process's CUDA
    context and communicators (what a fake-CUDA ledger must hold too: tests/unit/engine/test_memory_ledger.py)."""
    return sum(i.on_device for i in _process_items(x, "rollout"))


def _phase(x: PlanInputs, name: str, *, first_step: bool = False) -> Phase:
    if name == "startup":
        return _startup(x)
    trainer = _trainer_items(x, name, first_step=first_step)
    # Training phases churn the caching allocator; before the sync and the KV cache's wake-up the engine empties it.
    frag = _fragmentation(trainer) if x.device.kind == "cuda" and name not in ("sync", "rollout") else []
    return Phase(name, tuple(_process_items(x, name) + trainer + frag + _vllm_items(x, name)))


def _trainer_items(x: PlanInputs, name: str, *, first_step: bool = False) -> list[Item]:
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


def _phase_names(x: PlanInputs) -> list[str]:
    names = ["startup"] + (["sync", "rollout"] if x.rollout.enabled else [])
    if x.old_logp_pass:
        names.append("old_logp")
    names += [n for n in OFFLOADABLE if getattr(x, n) is not None or (n == "reference" and x.reference_from_actor)]
    names.append("update")
    return names + (["critic_update"] if x.critic is not None else [])


def estimate(x: PlanInputs, *, with_fixes: bool = True) -> MemoryPlan:
    """The per-rank memory of every phase, with notes and (when something does not fit) the fixes."""
    from hybrid_rl.model.memory_advice import fixes_for, notes_for

    phases = tuple(_phase(x, n) for n in _phase_names(x))
    plan = MemoryPlan(x, phases)
    first = _phase(x, "rollout", first_step=True) if x.rollout.enabled else None
    notes = tuple(notes_for(plan, first))
    fixes = tuple(fixes_for(plan)) if with_fixes else ()
    return MemoryPlan(x, phases, notes, fixes)
