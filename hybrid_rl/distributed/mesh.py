"""The process group and its shape: one torchrun world shared by FSDP2 (all ranks) and vLLM (TP groups).

Ranks are laid out DP-major: rank = dp_rank * tp + tp_rank, which is how vLLM's external launcher
forms its tensor-parallel groups (consecutive ranks). FSDP shards every weight over `shard` ranks and replicates
that over world // shard groups of them (HSDP): shard = world is plain FSDP, shard = 1 keeps every weight whole on
every rank (a gradient all-reduce per step and no gathers, for models whose state fits every rank).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    """World shape: `tp` ranks per vLLM tensor-parallel group, `dp` = world // tp groups; FSDP splits each weight
    over `shard` ranks (0: the world; `fsdp_mesh`)."""

    world: int
    rank: int
    local_rank: int
    tp: int
    shard: int = 0

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world % self.tp:
            raise ValueError(
                f"rollout.tp={self.tp} must be >= 1 and divide the number of ranks ({self.world}); "
                f"allowed: {[d for d in range(1, self.world + 1) if self.world % d == 0]}"
            )

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def device() -> torch.device:
    """This rank's compute device: its CUDA device under torchrun on GPUs, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def backend_for(*, cuda: bool) -> str:
    """The world's backend string: gloo serves CPU tensors everywhere, nccl the CUDA ones on GPUs.

    A CUDA world needs both: FSDP and the weight sync move CUDA tensors (nccl), while object
    collectives, checkpoint agreement and vLLM's own CPU groups move CPU tensors (gloo). With
    `nccl` alone the first CPU collective fails ("No backend type associated with device type cpu").
    """
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_distributed(tp: int, *, timeout_s: int = 1800) -> ParallelDims:
    """Join the torchrun world (see `backend_for`); a single process without torchrun is a world of 1."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    dims = ParallelDims(world, int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), tp)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # plain `python ...`: a world of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                              LOCAL_RANK="0")
        cuda = torch.cuda.is_available()
        kwargs = {}
        if cuda:
            torch.cuda.set_device(dims.local_rank)
            # vLLM's external launcher splits its groups off this one, which needs it bound to a device.
            kwargs["device_id"] = torch.device("cuda", dims.local_rank)
        dist.init_process_group(backend_for(cuda=cuda), timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dims


def free_port() -> int:
    """A TCP port free on this host now (for a single-process or spawned-workers rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TP_GROUPS: dict[int, object] = {}


def tp_group(dims: ParallelDims):
    """The gloo group of this rank's vLLM TP group (its `tp` consecutive ranks), for the object collectives' `group=`
    (`collectives.all_gather_object`); None at tp=1. Collective the first time for a TP size (every rank creates every
    group, in the same order), cached after."""
    if dims.tp == 1:
        return None
    if dims.tp not in _TP_GROUPS:
        _TP_GROUPS[dims.tp], _ = dist.new_subgroups(group_size=dims.tp, backend="gloo")
    return _TP_GROUPS[dims.tp]


def check_shard_size(shard: int, world: int) -> None:
    if shard < 1 or world % shard:
        raise ValueError(f"trainer.shard_size={shard} must divide the number of ranks ({world}); "
                         f"allowed: 0 (auto) or {[d for d in range(1, world + 1) if world % d == 0]}")


def fsdp_mesh(dims: ParallelDims):
    """The device mesh FSDP2 shards over: 1-D over every rank (`dims.shard` 0 or the world: each weight W ways), else
    2-D (replicate x shard, HSDP): rank r is replica r // shard, holding shard r % shard (`reshard.held_ranges`)."""
    from torch.distributed.device_mesh import init_device_mesh

    shard = dims.shard or dims.world
    check_shard_size(shard, dims.world)
    if shard == dims.world:
        return init_device_mesh(device().type, (dims.world,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device().type, (dims.world // shard, shard), mesh_dim_names=("replicate", "shard"))
