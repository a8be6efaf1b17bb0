"""Every collective the trainer needs, each knowing which device its tensors must be on.

The world is `cpu:gloo,cuda:nccl` on GPUs and `gloo` on CPU (`mesh.backend_for`). A tensor is sent
from the communication device (`comm_device`: this rank's GPU in a CUDA world, where nccl is fast
across nodes; else the CPU) and every result comes back on the device the caller's tensor was on.
Outside `hybrid_rl/dist/` and `hybrid_rl/engine/` (the resharder drives its own all-to-alls) no
module calls `torch.distributed` collectives directly: a test reads the source to keep it so.

In a world of one (no torchrun, or `WORLD_SIZE=1`) every function returns its input's value
without touching `torch.distributed`.

Shape letters: `n` rows this rank has, `N` rows of all ranks together.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_object",
    "all_gather_rows",
    "all_reduce",
    "all_reduce_max",
    "all_reduce_min",
    "all_reduce_sum",
    "all_to_all_rows",
    "barrier",
    "broadcast_object",
    "comm_device",
    "comm_device_for",
    "world_size",
]


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def comm_device_for(*, cuda: bool, local_rank: int) -> torch.device:
    """Where collective payloads live: the rank's GPU in a CUDA world (nccl), else the CPU (gloo)."""
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def comm_device() -> torch.device:
    return comm_device_for(cuda=torch.cuda.is_available(), local_rank=int(os.environ.get("LOCAL_RANK", 0)))


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`t` reduced elementwise over ranks (`sum`, `max` or `min`), as a new tensor on `t`'s device."""
    if world_size() == 1:
        return t.clone()
    buf = t.to(comm_device(), copy=True)
    dist.all_reduce(buf, op=_OPS[op])
    return buf.to(t.device)


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few floats over all ranks (one collective, float64)."""
    return all_reduce(torch.tensor(values, dtype=torch.float64), "sum").tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    return all_reduce(torch.tensor(values, dtype=torch.float64), "max").tolist()


def all_reduce_min(values: list[float]) -> list[float]:
    return all_reduce(torch.tensor(values, dtype=torch.float64), "min").tolist()


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` ([n, ...], n may differ between ranks), concatenated in rank order: [N, ...]."""
    world = world_size()
    if world == 1:
        return t.clone()
    dev = comm_device()
    counts = torch.tensor([t.shape[0]], dtype=torch.int64, device=dev)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    sizes = [int(c) for c in all_counts]
    padded = torch.zeros((max(sizes), *t.shape[1:]), dtype=t.dtype, device=dev)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]).to(t.device)


def all_to_all_rows(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Send `chunks[d]` ([n_d, ...], same trailing shape and dtype) to rank d; returns what each rank sent here.

    Two collectives: the row counts, then the rows themselves in one `all_to_all_single`.
    """
    world = world_size()
    assert len(chunks) == world, f"need one chunk per rank ({world}), got {len(chunks)}"
    if world == 1:
        return [chunks[0].clone()]
    dev, src_device = comm_device(), chunks[0].device
    send_counts = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64, device=dev)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send = torch.cat(chunks).to(dev)
    recv_sizes = recv_counts.tolist()
    recv = torch.empty((sum(recv_sizes), *send.shape[1:]), dtype=send.dtype, device=dev)
    dist.all_to_all_single(recv, send, recv_sizes, send_counts.tolist())
    return list(recv.to(src_device).split(recv_sizes))


def all_gather_object(obj: Any, *, group: Any = None) -> list[Any]:
    """Every rank's small picklable `obj`, in rank order (sent over gloo, the CPU backend); with `group` (from
    `mesh.tp_group`), the ranks of that group only."""
    size = world_size() if group is None else dist.get_world_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, *, src: int = 0) -> Any:
    """Rank `src`'s small picklable `obj` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
