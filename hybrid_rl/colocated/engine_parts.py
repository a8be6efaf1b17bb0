"""The groups `HybridEngine` is built from: the policy it syncs, where the weights go, and how it switches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_rl.colocated.lora_sync import AdapterSync
from hybrid_rl.colocated.vllm_engine import VLLMEngine
from hybrid_rl.weightsync.layout import Layout
from hybrid_rl.weightsync.source import WeightSource


@dataclass(frozen=True)
class SwitchOptions:
    """How the engine switches modes and syncs weights (filled from the `rollout` and `offload` configs)."""

    bucket_bytes: int
    verify: bool
    probe_cols: int
    release: str  # how vLLM gives memory back in train mode: keep | sleep (CUDA) | restart
    offload_params: str  # none | cpu | disk
    offload_grads: str
    offload_optim: str
    cpu_shm_sync: bool = True  # CPU: the sync's buckets through shared memory (`reshard.shared_exchange`)


@dataclass(frozen=True)
class TrainedPolicy:
    """The policy the engine syncs: its module and optimizer, the tensors sent (None: the module's own) and, with
    `model.lora.sync=adapter`, the adapter that goes to vLLM by itself after each sync."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    weights: WeightSource | None = None
    adapter: AdapterSync | None = None


@dataclass(frozen=True)
class SyncTarget:
    """Where the weights go: the in-process vLLM, its TP layout, and the device and dtype they travel in."""

    vllm: VLLMEngine
    layout: Layout
    device: torch.device
    dtype: torch.dtype
