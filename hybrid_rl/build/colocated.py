"""The colocated deployment (`rollout.mode=colocated`): vLLM in-process on the training ranks (the hybrid engine)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid_rl.build.rollout import adapter_sync, agent_setup, sampling_settings, uses_tools
from hybrid_rl.build.settings import router_replay
from hybrid_rl.colocated.engine_parts import SyncTarget, TrainedPolicy
from hybrid_rl.colocated.hybrid import HybridEngine, SwitchOptions
from hybrid_rl.colocated.lora_sync import AdapterSync
from hybrid_rl.colocated.multi_turn import MultiTurnRollout
from hybrid_rl.colocated.sampler import Sampler
from hybrid_rl.colocated.vllm_engine import EngineSpec, VLLMEngine
from hybrid_rl.config import Config, resolve_rollout, speculation
from hybrid_rl.distributed.mesh import ParallelDims, device
from hybrid_rl.distributed.offload import OffloadManager
from hybrid_rl.model.handle import Model
from hybrid_rl.model.loading import DTYPES
from hybrid_rl.model.lora import BaseWeights, LoraWeights, is_lora
from hybrid_rl.planner.result import MemoryPlan
from hybrid_rl.planner.vllm_memory import plan_sync_reserve
from hybrid_rl.weightsync.layout import Layout, ModelDims


def build(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager, tokenizer,
          plan: MemoryPlan) -> Sampler | MultiTurnRollout:
    """The hybrid engine: vLLM in-process on the training ranks; with tools, driven turn by turn."""
    sampler = Sampler(_engine(cfg, dims, actor, offload, plan), tokenizer, dims, sampling_settings(cfg),
                      seed=cfg.trainer.seed)
    return MultiTurnRollout(sampler, tokenizer, agent_setup(cfg, tokenizer)) if uses_tools(cfg) else sampler


def check(cfg: Config, world: int, hf_config) -> None:
    ParallelDims(world, 0, 0, cfg.rollout.tp)


def _engine(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager, plan: MemoryPlan) -> HybridEngine:
    r = cfg.rollout
    d = resolve_rollout(r, "cuda" if torch.cuda.is_available() else "cpu")  # as the memory planner resolves it
    adapter_on = adapter_sync(cfg)
    bucket_bytes = int(r.bucket_mb * 2**20)
    # R3 replays vLLM's routes for the prompt too: with the prefix cache on, a cached prompt's tokens are not
    # computed (no routes to capture), so it is off; the capture hook copies to the host, which CUDA graphs cannot
    capture = router_replay(cfg) == "rollout"
    spec = EngineSpec(model_path=cfg.model.path, tp=r.tp, dtype=r.dtype,
                      max_model_len=r.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens,
                      seed=cfg.trainer.seed, enforce_eager=d.enforce_eager or capture,
                      gpu_memory_utilization=d.gpu_memory_utilization,
                      sync_reserve_bytes=plan_sync_reserve(plan.inputs), kv_cache_gb=d.kv_cache_gb,
                      sleep_mode=d.release == "sleep", shm_ledger_dir=str(Path(cfg.trainer.output_dir) / "vllm_shm"),
                      max_lora_rank=cfg.model.lora.rank if adapter_on else 0,
                      cpu_packed_linears=r.cpu_packed_linears, enable_prefix_caching=not capture,
                      capture_routes=capture, speculation=speculation(r))
    o = cfg.offload
    options = SwitchOptions(bucket_bytes=bucket_bytes, verify=r.verify, probe_cols=r.verify_probe_cols,
                            release=d.release, offload_params=o.actor_params, offload_grads=o.actor_grads,
                            offload_optim=o.actor_optim, cpu_shm_sync=r.cpu_shm_sync)
    layout = Layout(ModelDims.from_hf_config(actor.module.config), r.tp)
    weights, adapter = (LoraWeights(actor.module) if is_lora(actor.module) else None), None
    if adapter_on:
        weights = BaseWeights(actor.module)
        adapter = AdapterSync(actor.module, Path(cfg.trainer.output_dir) / "adapter_sync", rank=dims.rank,
                              dtype=DTYPES[r.dtype])
    return HybridEngine(TrainedPolicy(actor.module, actor.optimizer, weights=weights, adapter=adapter),
                        SyncTarget(VLLMEngine(spec), layout, device=device(), dtype=DTYPES[r.dtype]),
                        dims=dims, offload=offload, options=options)
