"""Config -> components. Wiring only: every decision lives in the component it configures.

The order matters for users: everything that can be checked cheaply (model folder, architecture,
TP size, datasets, reward functions) is checked before any weight is loaded, so a bad input fails
in seconds with a message that names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_rl.config import Config, ConfigError, resolve_rollout
from hybrid_rl.data import PromptLoader, load_prompt_dataset
from hybrid_rl.dist.collectives import all_reduce_min
from hybrid_rl.dist.etcd import Etcd, EtcdUnavailable
from hybrid_rl.dist.fsdp import is_sharded, shard_model
from hybrid_rl.dist.mesh import ParallelDims, device, fsdp_mesh, init_distributed
from hybrid_rl.dist.offload import OffloadManager
from hybrid_rl.engine.checkpoint_engine import CheckpointEngine, PushOptions
from hybrid_rl.engine.completions import CompletionClient
from hybrid_rl.engine.hybrid import HybridEngine, ModuleWeights, SwitchOptions
from hybrid_rl.engine.layout import Layout, ModelDims, check_architecture
from hybrid_rl.engine.pod_link import pod_link
from hybrid_rl.engine.sidecar_server import Sidecar
from hybrid_rl.engine.vllm_engine import EngineSpec, VLLMEngine
from hybrid_rl.engine.vllm_server import ServerError, ServerSpec, check_python, port_free
from hybrid_rl.model.handle import Model
from hybrid_rl.model.loading import DTYPES, empty_model, enable_activation_checkpointing, load_config, load_tokenizer
from hybrid_rl.model.lora import LoraWeights, apply_lora, is_lora
from hybrid_rl.model.materialize import materialize
from hybrid_rl.model.memory_plan import MemoryPlan, sync_reserve_bytes
from hybrid_rl.model.param_count import Head
from hybrid_rl.planner import detect_device, plan_for, training_records
from hybrid_rl.rewards import RewardPool, Rubric, RubricItem, resolve_reward
from hybrid_rl.rollout.base import RolloutWorker
from hybrid_rl.rollout.sampler import Sampler, SamplingSettings
from hybrid_rl.rollout.sidecar import SidecarOptions, SidecarRollout
from hybrid_rl.utils.schedule import lr_multiplier

log = logging.getLogger(__name__)


@dataclass
class Components:
    cfg: Config
    dims: ParallelDims
    tokenizer: object
    actor: Model
    rollout: RolloutWorker
    train_loader: PromptLoader
    val_records: list
    rewards: RewardPool | None
    reference: Model | None
    critic: Model | None
    reward_model: Model | None
    offload: OffloadManager
    plan: MemoryPlan


def check_inputs(cfg: Config, world: int) -> None:
    """Cheap checks of everything the user pointed at, before any heavy work."""
    hf = load_config(cfg.model.path)
    arch = (getattr(hf, "architectures", None) or [type(hf).__name__])[0]
    check_architecture(arch)
    resolve_rollout(cfg.rollout, "cuda" if torch.cuda.is_available() else "cpu")  # what this platform cannot do
    ROLLOUT_CHECKS[cfg.rollout.mode](cfg, world, hf)
    for name in (cfg.reward.model_path, cfg.critic.path):
        if name and not Path(name).is_dir():
            raise ConfigError(f"{name!r} (reward.model_path / critic.path) is not a model folder")


def build(cfg: Config) -> Components:
    dims = init_distributed(cfg.rollout.tp if cfg.rollout.mode == "colocated" else 1)
    _seed_everything(cfg.trainer.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer in model.path={cfg.model.path!r} has no EOS token: generation cannot stop")
    loader, val_records = _datasets(cfg, tokenizer)
    plan = _check_memory(cfg, dims, [len(r.prompt_ids) for r in loader.dataset])
    rewards = None if cfg.algorithm.offline_pairs else _rewards(cfg)

    actor = _actor(cfg, dims)
    offload = OffloadManager(cfg.offload.dir or Path(cfg.trainer.output_dir) / "offload", rank=dims.rank)
    rollout = ROLLOUT_MODES[cfg.rollout.mode](cfg, dims, actor, offload, tokenizer)
    a = cfg.algorithm
    # With LoRA the reference is the actor's own frozen base (adapter disabled): no second copy.
    reference = _frozen(cfg.model.path, "lm", cfg, dims) if a.use_reference and not cfg.model.lora.rank else None
    critic = _critic(cfg, dims) if a.use_critic else None
    rm = _frozen(cfg.reward.model_path, "score", cfg, dims) if cfg.reward.model_path else None
    return Components(cfg, dims, tokenizer, actor, rollout, loader, val_records, rewards, reference, critic, rm,
                      offload, plan)


def _check_memory(cfg: Config, dims: ParallelDims, prompt_lengths: list[int]) -> MemoryPlan:
    """The memory plan of this run, printed (rank 0) before any weight loads; one that does not fit stops here."""
    device = detect_device(local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", dims.world)))
    # Every rank plans for the smallest budget any rank sees (host memory available differs by the moment it is
    # read), so that all reach the same verdict: one rank stopping alone would leave the others waiting.
    device = dataclasses.replace(device, total_bytes=int(all_reduce_min([float(device.total_bytes)])[0]))
    plan = plan_for(cfg, dims.world, device=device, prompt_lengths=prompt_lengths)
    if dims.is_main:
        print(plan.table(), flush=True)
    if not plan.fits and cfg.trainer.memory_check == "error":
        raise ConfigError(f"the memory plan above does not fit (trainer.memory_check=error): {plan.verdict()}\n"
                          "Apply the settings it lists, or start anyway with trainer.memory_check=warn.")
    return plan


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _datasets(cfg: Config, tokenizer):
    d = cfg.data
    train = training_records(cfg, tokenizer)
    if len(train) < d.prompts_per_step:
        raise ConfigError(f"data.prompts_per_step={d.prompts_per_step} is more than the {len(train)} usable rows of "
                          f"data.train_files (after dropping over-long prompts); lower it or add data")
    loader = PromptLoader(train, d.prompts_per_step, seed=cfg.trainer.seed, shuffle=d.shuffle)
    val = []
    if d.val_files:
        val = list(load_prompt_dataset(d.val_files, tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                                       prompt_key=d.prompt_key, apply_chat_template=d.apply_chat_template))
        val = val[: d.val_prompts] if d.val_prompts else val
    return loader, val


def _rewards(cfg: Config) -> RewardPool:
    r = cfg.reward
    specs = [(r.fn, 1.0, "")] if r.fn else [(f.name, f.weight, f.pattern) for f in r.fns]
    items = []
    for name, weight, pattern in specs:
        fn = resolve_reward(name, pattern=pattern) if name == "format" else resolve_reward(name)
        items.append(RubricItem(name.rsplit(":", 1)[-1], fn, weight))
    return RewardPool(Rubric(items), r.num_workers, timeout_s=r.timeout_s)


def _scheduler(opt, cfg: Config, warmup: int):
    f = lr_multiplier(warmup_steps=warmup, total_steps=cfg.trainer.total_steps, schedule=cfg.optim.schedule,
                      min_ratio=cfg.optim.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def _shard(module: torch.nn.Module, path: str, cfg: Config, dims: ParallelDims) -> torch.nn.Module:
    """Shard a meta-device model, then fill this rank's shards from the checkpoint (never the whole model)."""
    shard_model(module, fsdp_mesh(dims), param_dtype=DTYPES[cfg.model.dtype])
    materialize(module, path, device=device(), seed=cfg.trainer.seed)
    return module


def _actor(cfg: Config, dims: ParallelDims) -> Model:
    module = empty_model(cfg.model.path, "lm")
    if cfg.model.activation_checkpointing:
        enable_activation_checkpointing(module)
    module.config.use_cache = False
    lora = cfg.model.lora
    if lora.rank:
        module = apply_lora(module, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                            target_modules=lora.target_modules)
        _store_frozen_in(module, DTYPES[cfg.model.frozen_storage_dtype])
    _shard(module, cfg.model.path, cfg, dims)
    o = cfg.optim
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    return Model(module, opt, _scheduler(opt, cfg, o.warmup_steps))


def _store_frozen_in(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """A LoRA actor's frozen base is stored like the frozen models (`model.frozen_dtype`); the adapters keep
    float32 master weights. (FSDP2 wants one dtype among a unit's trainable parameters only.)"""
    for p in module.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)


def _critic(cfg: Config, dims: ParallelDims) -> Model:
    path = cfg.critic.path or cfg.model.path
    module = empty_model(path, "value")
    module.config.use_cache = False
    _shard(module, path, cfg, dims)
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.critic.lr, betas=tuple(cfg.optim.betas))
    return Model(module, opt, _scheduler(opt, cfg, cfg.critic.warmup_steps))


def _frozen(path: str, head: Head, cfg: Config, dims: ParallelDims) -> Model:
    """Reference or reward model: no gradients; its shards stored in `model.frozen_dtype`."""
    module = empty_model(path, head, dtype=DTYPES[cfg.model.frozen_storage_dtype])
    module.requires_grad_(False)
    return Model(_shard(module, path, cfg, dims))


def sampling_settings(cfg: Config) -> SamplingSettings:
    r = cfg.rollout
    return SamplingSettings(r.max_new_tokens, r.temperature, r.top_p, r.top_k)


def _colocated(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager, tokenizer) -> Sampler:
    """The hybrid engine: vLLM in-process on the training ranks."""
    return Sampler(_engine(cfg, dims, actor, offload), tokenizer, dims, sampling_settings(cfg), seed=cfg.trainer.seed)


def _check_colocated(cfg: Config, world: int, hf_config) -> None:
    ParallelDims(world, 0, 0, cfg.rollout.tp)


def sidecar_prefix(cfg: Config) -> str:
    """The run's etcd prefix (`sidecar.prefix`, or one named after the output folder)."""
    return cfg.sidecar.prefix or f"/hybrid_rl/{Path(cfg.trainer.output_dir).resolve().name}"


def sidecar_namespace(cfg: Config, pod: int) -> str:
    """The pod's shared-memory namespace: unique per run (etcd endpoint and prefix) and pod."""
    digest = hashlib.sha1(f"{cfg.sidecar.etcd}{sidecar_prefix(cfg)}".encode()).hexdigest()[:10]
    return f"hrl-{digest}-pod{pod}"


def _check_sidecar(cfg: Config, world: int, hf_config) -> None:
    """Everything a sidecar run needs that can fail in seconds: TP vs heads and ranks, the server's interpreter,
    its port (on the node that starts it) and etcd."""
    sc, tp = cfg.sidecar, cfg.rollout.tp
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if tp > min(local, world):
        raise ConfigError(f"rollout.tp={tp}: the vLLM sidecar's TP size must be at most the trainer ranks of its pod "
                          f"({min(local, world)}): each server TP rank gets its weights from one trainer rank")
    try:
        Layout(ModelDims.from_hf_config(hf_config), tp)
    except ValueError as e:
        raise ConfigError(f"rollout.tp={tp} does not fit the model: {e}") from None
    try:
        check_python(sc.python or sys.executable)
    except ServerError as e:
        raise ConfigError(str(e)) from None
    if int(os.environ.get("RANK", 0)) == 0 and not port_free(sc.host, sc.port):
        raise ConfigError(f"sidecar.port={sc.port}: the port is taken on {sc.host}; choose a free one")
    try:
        Etcd(sc.etcd, sidecar_prefix(cfg), wait_s=0).check()
    except (EtcdUnavailable, ValueError) as e:
        raise ConfigError(str(e)) from None


def _sidecar(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager, tokenizer) -> SidecarRollout:
    """A vLLM server beside the trainer (started here by rank 0, serving after a minute), fed by the checkpoint
    engine; other pods (`python -m hybrid_rl.pod`) get each update through the pod group."""
    r, sc = cfg.rollout, cfg.sidecar
    d = resolve_rollout(r, "cuda" if torch.cuda.is_available() else "cpu")
    etcd = Etcd(sc.etcd, sidecar_prefix(cfg), wait_s=sc.etcd_wait_s)
    sidecar = None
    if dims.rank == 0:
        sidecar = Sidecar(server_spec(cfg, port=sc.port, log_path=Path(cfg.trainer.output_dir) / "vllm_server.log"),
                          etcd, pod=0, ttl_s=sc.lease_ttl_s, start_timeout_s=sc.start_timeout_s)
        sidecar.start(wait=False)  # it loads while the trainer builds its models; the first session waits
    layout = Layout(ModelDims.from_hf_config(actor.module.config), r.tp)
    options = PushOptions(int(r.bucket_mb * 2**20), sc.slots, r.verify_probe_cols, sc.update_timeout_s)
    link = pod_link(etcd, dims, host=sc.host, tp=r.tp, pods=sc.pods, wait_s=sc.pod_wait_s) if sc.pods > 1 else None
    engine = CheckpointEngine(rank=dims.rank, world=dims.world, layout=layout, namespace=sidecar_namespace(cfg, 0),
                              options=options, device=device(), dtype=DTYPES[r.dtype],
                              server=(lambda: sidecar.server) if sidecar is not None else None, link=link)
    o = cfg.offload
    # Asynchronous runs generate while the trainer trains: the server never sleeps (give it its own GPUs).
    opts = SidecarOptions(o.actor_params, o.actor_grads, o.actor_optim, sc.max_restarts, sc.sleep_level,
                          sleep=d.release == "sleep" and r.max_staleness == 0)
    weights = LoraWeights(actor.module) if is_lora(actor.module) else ModuleWeights(actor.module)
    return SidecarRollout(policy=actor.module, optimizer=actor.optimizer, dims=dims, weights=weights, engine=engine,
                          sidecar=sidecar, etcd=etcd,
                          client=CompletionClient(max_inflight=sc.max_inflight, timeout_s=sc.request_timeout_s),
                          stream=CompletionClient(max_inflight=sc.max_inflight, timeout_s=sc.request_timeout_s),
                          offload=offload, options=opts, tokenizer=tokenizer, settings=sampling_settings(cfg),
                          seed=cfg.trainer.seed, sharded=any(is_sharded(p) for p in actor.module.parameters()))


def server_spec(cfg: Config, *, port: int, log_path: Path) -> ServerSpec:
    """The vLLM sidecar of one pod, from the rollout config (resolved for this platform)."""
    r, sc = cfg.rollout, cfg.sidecar
    cuda = torch.cuda.is_available()
    d = resolve_rollout(r, "cuda" if cuda else "cpu")
    return ServerSpec(model_path=cfg.model.path, tp=r.tp, dtype=r.dtype, port=port, host=sc.host,
                      max_model_len=r.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens,
                      seed=cfg.trainer.seed, enforce_eager=d.enforce_eager, log_path=str(log_path),
                      python=sc.python or sys.executable, kv_cache_gb=d.kv_cache_gb,
                      gpu_memory_utilization=d.gpu_memory_utilization, sleep_mode=d.release == "sleep", cuda=cuda)


# rollout.mode -> builder of the rollout worker (one signature: cfg, dims, actor, offload, tokenizer)
ROLLOUT_MODES = {"colocated": _colocated, "sidecar": _sidecar}
# rollout.mode -> its cheap start-up checks (cfg, world, the model's HF config), run before any weight is loaded
ROLLOUT_CHECKS = {"colocated": _check_colocated, "sidecar": _check_sidecar}


def _engine(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager) -> HybridEngine:
    r = cfg.rollout
    d = resolve_rollout(r, "cuda" if torch.cuda.is_available() else "cpu")  # as the memory planner resolves it
    bucket_bytes = int(r.bucket_mb * 2**20)
    spec = EngineSpec(model_path=cfg.model.path, tp=r.tp, dtype=r.dtype,
                      max_model_len=r.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens,
                      seed=cfg.trainer.seed, enforce_eager=d.enforce_eager,
                      gpu_memory_utilization=d.gpu_memory_utilization,
                      sync_reserve_bytes=sync_reserve_bytes(bucket_bytes), kv_cache_gb=d.kv_cache_gb,
                      sleep_mode=d.release == "sleep", shm_ledger_dir=str(Path(cfg.trainer.output_dir) / "vllm_shm"),
                      cpu_packed_linears=r.cpu_packed_linears)
    o = cfg.offload
    options = SwitchOptions(bucket_bytes=bucket_bytes, verify=r.verify, probe_cols=r.verify_probe_cols,
                            release=d.release, offload_params=o.actor_params, offload_grads=o.actor_grads,
                            offload_optim=o.actor_optim)
    layout = Layout(ModelDims.from_hf_config(actor.module.config), r.tp)
    weights = LoraWeights(actor.module) if is_lora(actor.module) else None
    return HybridEngine(actor.module, optimizer=actor.optimizer, dims=dims, vllm=VLLMEngine(spec), layout=layout,
                        offload=offload, options=options, device=device(), sync_dtype=DTYPES[r.dtype],
                        weights=weights)
