"""The groups `SidecarRollout` is built from: what it syncs, how it reaches the servers, and its options."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_rl.sidecar.checkpoint_engine import CheckpointEngine
from hybrid_rl.sidecar.completions import CompletionClient
from hybrid_rl.sidecar.etcd import Etcd, Registration
from hybrid_rl.sidecar.etcd_server import EtcdProcess
from hybrid_rl.sidecar.server_adapter import AdapterPublisher
from hybrid_rl.sidecar.sidecar_server import Sidecar
from hybrid_rl.weightsync.source import WeightSource


@dataclass(frozen=True)
class SyncedPolicy:
    """What each session brings to the servers: the policy's weights; its train state is offloaded around it."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    weights: WeightSource  # the tensors pushed (with an adapter sync: the frozen base, where a server lacks it)
    sharded: bool  # the policy's parameters are FSDP shards
    shard: int = 0  # ranks each of them is split over (HSDP's shard size; 0: the world)
    adapter: AdapterPublisher | None = None  # `model.lora.sync=adapter`: each update is the adapter alone


@dataclass(frozen=True)
class ServerLinks:
    """How the rollout reaches its servers: the weight push, etcd, and the request clients."""

    engine: CheckpointEngine
    etcd: Etcd
    client: CompletionClient  # synchronous rollouts
    stream: CompletionClient  # streaming (asynchronous training): requests stay in flight across sessions
    sidecar: Sidecar | None = None  # a TP group's leader: the server it starts, watches and drives
    run_id: str = ""  # in every key and weight version of the run
    private_etcd: EtcdProcess | None = None  # rank 0 of a one-pod run given no sidecar.etcd: stopped at close
    announcement: Registration | None = None  # rank 0: the run announced to rollout-only pods (closed at close)


@dataclass(frozen=True)
class SidecarOptions:
    offload_params: str  # none | cpu | disk (`offload.actor_params`)
    offload_grads: str
    offload_optim: str
    max_restarts: int
    sleep_level: int  # CUDA: 1 or 2
    sleep: bool  # CUDA sleep mode between phases
    max_inflight: int = 0  # requests in flight per rank (`sidecar.max_inflight`); 0 = sized from the servers' KV
    max_num_seqs: int = 256  # each server's `--max-num-seqs`
    request_tokens: int = 1  # the most tokens one request holds in the KV cache (prompt + response budget)
    servers: int = 1  # the run's servers (every pod's)
    seed: int = 0  # request seeds depend only on it, the step and the sample
    adapter_timeout_s: float = 600.0  # loading an adapter on a server
