"""Config -> components. Wiring only: every decision lives in the component it configures.

The order matters for users: everything that can be checked cheaply (model folder, architecture,
TP size, datasets, reward functions) is checked before any weight is loaded, so a bad input fails
in seconds with a message that names it.

The deployments (`rollout.mode`) are one registry, `DEPLOYMENTS`: each names its cheap start-up checks and the
builder of its rollout worker, in its own file here (`colocated.py`, `sidecar.py`). Their wiring reads the
config, so it lives in build/ (above config in the layers), not in the deployments' packages (below it).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybrid_rl.build import colocated, sidecar
from hybrid_rl.build.rollout import (
    adapter_sync,
    agent_setup,
    black_box_family,
    sampling_settings,
    tool_schemas,
    uses_tools,
)
from hybrid_rl.build.settings import trainer_settings
from hybrid_rl.build.sidecar import (
    RUN_ID_FILE,
    adapter_versions,
    max_inflight,
    measured_utilization,
    server_spec,
    servers_per_node,
    sidecar_namespace,
    sidecar_prefix,
    sidecar_run_id,
)
from hybrid_rl.components import Components
from hybrid_rl.config import Config, ConfigError, resolve_rollout
from hybrid_rl.data import PromptLoader, load_prompt_dataset
from hybrid_rl.distributed.collectives import all_reduce_min
from hybrid_rl.distributed.fsdp import shard_model
from hybrid_rl.distributed.mesh import ParallelDims, device, fsdp_mesh, init_distributed
from hybrid_rl.distributed.offload import OffloadManager
from hybrid_rl.model.handle import Model
from hybrid_rl.model.loading import DTYPES, empty_model, enable_activation_checkpointing, load_config, load_tokenizer
from hybrid_rl.model.lora import apply_lora
from hybrid_rl.model.materialize import materialize
from hybrid_rl.model.optimizers import build_optimizer
from hybrid_rl.model.teacher import check_teacher
from hybrid_rl.plan_inputs import detect_device, plan_for, training_records
from hybrid_rl.planner.result import MemoryPlan
from hybrid_rl.planner.table import render, verdict
from hybrid_rl.rewards import RewardPool, Rubric, RubricItem, resolve_reward
from hybrid_rl.rollout.base import RolloutWorker
from hybrid_rl.rollout.chat_template import with_tools
from hybrid_rl.rollout.tools import EnvironmentReward, load_environment
from hybrid_rl.types import Head
from hybrid_rl.utils.env import keep_freed_memory
from hybrid_rl.utils.schedule import lr_multiplier
from hybrid_rl.weightsync.layout import check_architecture

__all__ = [
    "DEPLOYMENTS", "RUN_ID_FILE", "Components", "Deployment", "adapter_sync", "adapter_versions", "agent_setup",
    "black_box_family", "build", "check_inputs", "max_inflight", "measured_utilization", "sampling_settings",
    "server_spec", "servers_per_node", "sidecar_namespace", "sidecar_prefix", "sidecar_run_id", "tool_schemas",
    "trainer_settings", "uses_tools",
]


@dataclass(frozen=True)
class Deployment:
    """One `rollout.mode`: how it is checked before any weight loads, and how its rollout worker is built."""

    check: Callable[[Config, int, Any], None]  # (cfg, world, the model's HF config): ConfigError for a bad input
    build: Callable[..., RolloutWorker]  # (cfg, dims, actor, offload, tokenizer, plan) -> the rollout worker
    run_id: Callable[[RolloutWorker], str] = lambda worker: ""  # the run's id, recorded in checkpoints


# rollout.mode -> its deployment
DEPLOYMENTS: dict[str, Deployment] = {
    "colocated": Deployment(check=colocated.check, build=colocated.build),
    "sidecar": Deployment(check=sidecar.check, build=sidecar.build, run_id=sidecar.run_id_of),
}


def check_inputs(cfg: Config, world: int) -> None:
    """Cheap checks of everything the user pointed at, before any heavy work."""
    hf = load_config(cfg.model.path)
    arch = (getattr(hf, "architectures", None) or [type(hf).__name__])[0]
    check_architecture(arch)
    resolve_rollout(cfg.rollout, "cuda" if torch.cuda.is_available() else "cpu")  # what this platform cannot do
    DEPLOYMENTS[cfg.rollout.mode].check(cfg, world, hf)
    if uses_tools(cfg):
        agent_setup(cfg, load_tokenizer(cfg.model.path))  # tools, environment, template: fail now (workers start later)
    if cfg.rollout.agent:
        black_box_family(cfg, load_tokenizer(cfg.model.path))
    for name in (cfg.reward.model_path, cfg.critic.path):
        if name and not Path(name).is_dir():
            raise ConfigError(f"{name!r} (reward.model_path / critic.path) is not a model folder")
    if cfg.teacher.path:
        check_teacher(cfg.model.path, cfg.teacher.path)


def build(cfg: Config) -> Components:
    dims = init_distributed(cfg.rollout.tp if cfg.rollout.mode == "colocated" else 1)
    _seed_everything(cfg.trainer.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer in model.path={cfg.model.path!r} has no EOS token: generation cannot stop")
    # With tools, prompts are rendered with their schemas (the chat template's `tools=`), as the model will see them.
    prompts_tokenizer = tokenizer
    if uses_tools(cfg):  # plain-string prompts refused unless an environment's reset may give the prompts
        prompts_tokenizer = with_tools(tokenizer, tool_schemas(cfg), raw_prompts=bool(cfg.rollout.environment))
    loader, val_records = _datasets(cfg, prompts_tokenizer)
    plan = _check_memory(cfg, dims, [len(r.prompt_ids) for r in loader.dataset])
    if plan.keeps_freed_host_memory:  # room for glibc to keep freed buffers: fewer page faults (CPU)
        keep_freed_memory()
    dims = dataclasses.replace(dims, shard=plan.inputs.shard_ranks)  # trainer.shard_size, or the plan's choice
    rewards = None if cfg.algorithm.offline_pairs else _rewards(cfg)

    actor = _actor(cfg, dims)
    offload = OffloadManager(cfg.offload.dir or Path(cfg.trainer.output_dir) / "offload", rank=dims.rank)
    deployment = DEPLOYMENTS[cfg.rollout.mode]
    rollout = deployment.build(cfg, dims, actor, offload, tokenizer, plan)
    a = cfg.algorithm
    # With LoRA the reference is the actor's own frozen base (adapter disabled): no second copy.
    reference = _frozen(cfg.model.path, "lm", cfg, dims) if a.use_reference and not cfg.model.lora.rank else None
    critic = _critic(cfg, dims) if a.use_critic else None
    if critic is not None:  # its optimizer state, once created, stays on the device through rollouts unless offloaded
        rollout.keep_room_for(critic.optimizer, cfg.offload.critic)
    rm = _frozen(cfg.reward.model_path, "score", cfg, dims) if cfg.reward.model_path else None
    settings = trainer_settings(cfg, world=dims.world, distil_only=rewards is None and rm is None)
    return Components(settings=settings, dims=dims, tokenizer=tokenizer, actor=actor,
                      rollout=rollout, train_loader=loader, val_records=val_records, rewards=rewards,
                      reference=reference, critic=critic, reward_model=rm, offload=offload, plan=plan,
                      run_id=deployment.run_id(rollout), teacher=_teacher(cfg, dims))


def _check_memory(cfg: Config, dims: ParallelDims, prompt_lengths: list[int]) -> MemoryPlan:
    """The memory plan of this run, printed (rank 0) before any weight loads; one that does not fit stops here."""
    device = detect_device(local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", dims.world)))
    # Every rank plans for the smallest budget any rank sees (host memory available differs by the moment it is
    # read), so that all reach the same verdict: one rank stopping alone would leave the others waiting.
    device = dataclasses.replace(device, total_bytes=int(all_reduce_min([float(device.total_bytes)])[0]))
    plan = plan_for(cfg, dims.world, device=device, prompt_lengths=prompt_lengths)
    if dims.is_main:
        print(render(plan), flush=True)
    if not plan.fits and cfg.trainer.memory_check == "error":
        raise ConfigError(f"the memory plan above does not fit (trainer.memory_check=error): {verdict(plan)}\n"
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


def _rewards(cfg: Config) -> RewardPool | None:
    r = cfg.reward
    specs = [(r.fn, 1.0, "")] if r.fn else [(f.name, f.weight, f.pattern) for f in r.fns]
    items = []
    for name, weight, pattern in specs:
        fn = resolve_reward(name, pattern=pattern) if name == "format" else resolve_reward(name)
        items.append(RubricItem(name.rsplit(":", 1)[-1], fn, weight))
    if cfg.rollout.environment and load_environment(cfg.rollout.environment).has_reward:
        items.append(RubricItem("environment", EnvironmentReward(), 1.0))  # the environment's reward(), weight 1
    if cfg.rollout.agent:
        items.append(RubricItem("agent", EnvironmentReward(), 1.0))  # what the agent returned (0 for None), weight 1
    if not items:  # no reward at all: pure on-policy distillation (config validation allows nothing else)
        return None
    return RewardPool(Rubric(items), r.num_workers, timeout_s=r.timeout_s)


def _teacher(cfg: Config, dims: ParallelDims) -> Model | None:
    """On-policy distillation's teacher (teacher.path), held like the reference: frozen, sharded, stored in
    `model.frozen_dtype`, offloaded per `offload.teacher`. Its vocabulary is checked by `check_inputs`; checked
    again here for callers that build without it (one cheap tokenizer load)."""
    if not cfg.teacher.path:
        return None
    check_teacher(cfg.model.path, cfg.teacher.path)
    return _frozen(cfg.teacher.path, "lm", cfg, dims)


def _scheduler(opt, cfg: Config, warmup: int):
    f = lr_multiplier(warmup_steps=warmup, total_steps=cfg.trainer.total_steps, schedule=cfg.optim.schedule,
                      min_ratio=cfg.optim.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def _shard(module: torch.nn.Module, path: str, cfg: Config, dims: ParallelDims) -> torch.nn.Module:
    """Shard a meta-device model, then fill this rank's shards from the checkpoint (never the whole model)."""
    shard_model(module, fsdp_mesh(dims), param_dtype=DTYPES[cfg.model.dtype],
                shared_memory=cfg.trainer.cpu_shm_collectives)
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
    opt = build_optimizer(o.name, trainable, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
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
    if cfg.model.activation_checkpointing:  # the critic's update keeps as many activations as the actor's, less logits
        enable_activation_checkpointing(module)
    module.config.use_cache = False
    _shard(module, path, cfg, dims)
    opt = build_optimizer(cfg.optim.name, module.parameters(), lr=cfg.critic.lr, betas=cfg.optim.betas,
                          weight_decay=0.01)  # torch AdamW's default, which the critic has always used
    return Model(module, opt, _scheduler(opt, cfg, cfg.critic.warmup_steps))


def _frozen(path: str, head: Head, cfg: Config, dims: ParallelDims) -> Model:
    """Reference or reward model: no gradients; its shards stored in `model.frozen_dtype`."""
    module = empty_model(path, head, dtype=DTYPES[cfg.model.frozen_storage_dtype])
    module.requires_grad_(False)
    return Model(_shard(module, path, cfg, dims))
