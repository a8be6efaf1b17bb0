"""What the planner is told: the models' shapes, the device, vLLM's settings, the offload targets."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_rl.planner.activations import Attention, SharedRows, shared_extra_rows
from hybrid_rl.planner.param_count import ArchDims, ParamShape, active_numel
from hybrid_rl.types import MATH_MAX_LEN, Head

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

    @property
    def active_numel(self) -> int:
        """Parameters one token goes through (a mixture of experts: `top_k` of each layer's experts)."""
        return active_numel(self.params, self.dims)

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
    router_replay: str = "none"  # model.moe.router_replay (a mixture of experts: `rollout` records vLLM's routes)
    step_tokens: int = 0  # tokens of the samples one rank trains on in a step (what their routes cover)
    shard: int = 0  # trainer.shard_size: ranks FSDP splits each weight over (HSDP), 0 = the world
    max_response_tokens: int = 0  # the longest response (rollout.max_new_tokens)
    prefix_share: int = 0  # trainer.prefix_share: rollout.n, the branches of a group's segment (0: off)
    shm_collectives: bool = True  # trainer.cpu_shm_collectives (CPU): FSDP's buffers in shared memory

    @property
    def shard_ranks(self) -> int:
        return self.shard or self.world

    def extra_rows(self, tokens: int) -> SharedRows:
        """Attention rows a micro-batch of `tokens` holds beyond them in the prefix-shared layout (none: off)."""
        return shared_extra_rows(tokens, self.prefix_share, self.max_sequence_tokens, self.max_response_tokens)

    @property
    def math_len(self) -> int:
        """Sequences up to this long run SDPA's math kernel in the update (CPU; 0: none do)."""
        return min(self.max_sequence_tokens, MATH_MAX_LEN) if self.device.kind == "cpu" and self.attention == "sdpa" else 0


def frees_device(target: str, device: DeviceSpec) -> bool:
    """Does offloading to `target` free device memory? `cpu` on a CPU-only device is a no-op."""
    return target == "disk" or (target == "cpu" and device.kind == "cuda")
