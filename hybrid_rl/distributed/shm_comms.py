"""FSDP2's all-gather and reduce-scatter through shared memory, for the ranks of one CPU host.

`gloo_comms` moves FSDP2's bytes by gloo's point-to-point sends, through loopback TCP. Between processes of one host
the bytes need not travel at all: FSDP2 asks a comm for its buffers (`allocate`), and here it gets views of shared
memory, so its own copy-in writes where every rank can read.

* **All-gather.** One output buffer serves the whole group: each rank's copy-in writes its shard at its place in
  it, the ranks meet at a barrier, and each copies the gathered weights out (FSDP2's copy-out). The buffer is a
  ring of `AG_SLOTS`: with backward prefetch FSDP2 issues a unit's all-gather before that unit's compute, but only
  after it copied out the one before; so when a rank passes the barrier of gather j - 1, every rank has copied out
  gather j - 2, and slot j % 2 may be written again.
* **Reduce-scatter.** Each rank's input (its whole unit's gradients, FSDP2's copy-in) goes to its own shared
  segment; after a barrier each rank sums its chunk of every rank's input into its output, then a second barrier
  lets the next reduce-scatter reuse the segments. It sums only, as `gloo_comms` (FSDP2 divides after).

Only the transformer blocks go through shared memory (`install`'s `max_numel`): the root unit (embeddings and head)
is gathered once a pass, and at a 150k vocabulary it is larger than several blocks, whose rings would all have to
grow to it. The segments grow when a block needs more (every rank asks the same sizes in the same order, so they
grow together) and are unlinked from /dev/shm as soon as every rank has mapped them. Where the ranks cannot share memory (several
hosts, /dev/shm too small), `install` keeps `gloo_comms`' pairwise exchanges.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from hybrid_rl.distributed import gloo_comms
from hybrid_rl.distributed.shm_exchange import aligned, map_segments

AG_SLOTS = 2  # the memory plan counts them (`planner/trainer_memory.shm_collective_bytes`)


class _Segments:
    """A group's shared segments of one kind, grown (collectively) to the largest size asked."""

    def __init__(self, group: dist.ProcessGroup, count: int, per_rank: bool, what: str, max_numel: int):
        self.group, self.count, self.per_rank, self.what = group, count, per_rank, what
        self.max_numel = max_numel  # larger requests (the root unit) keep the pairwise exchanges
        self.size, self.maps, self.uses = 0, None, 0
        self.usable = True

    def take(self, numel: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Collective: the next slot ([rank] segments, or one for the group) for `numel` elements; None for a request
        over `max_numel`, or when shared memory is not to be had (then for good)."""
        if not self.usable or numel > self.max_numel:
            return None
        nbytes = numel * dtype.itemsize
        if nbytes > self.size:
            size = aligned(nbytes)
            world = self.group.size()
            sizes = [size] * world if self.per_rank else [size] + [0] * (world - 1)
            self.maps = map_segments(sizes, self.count, self.group, what=self.what)
            if self.maps is None:
                self.usable = False
                return None
            self.size, self.uses = size, 0
        k = self.uses % self.count
        self.uses += 1
        return [mine[k] for mine in self.maps if mine]


class ShmAllGather(AllGather):
    """`output` = every rank's `input` in rank order, in a shared buffer every rank of the group wrote its part of."""

    def __init__(self, group: dist.ProcessGroup, fallback: AllGather, max_numel: int):
        self.group, self.fallback = group, fallback
        self.segments = _Segments(group, AG_SLOTS, per_rank=False, what="FSDP's all-gathers", max_numel=max_numel)
        self.handed: int | None = None  # data pointer of the last buffer handed out, where it is shared memory

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = int(torch.Size(size).numel())
        slot = self.segments.take(numel, dtype) if device.type == "cpu" else None
        if slot is None:
            self.handed = None
            return torch.empty(*size, dtype=dtype, device=device)
        out = slot[0][: numel * dtype.itemsize].view(dtype).view(*size)
        self.handed = out.data_ptr()
        return out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        if output_tensor.data_ptr() != self.handed:
            return self.fallback(output_tensor, input_tensor, group, async_op)
        rank, n = group.rank(), input_tensor.numel()
        mine = output_tensor.view(group.size(), n)[rank]
        if mine.data_ptr() != input_tensor.data_ptr():  # FSDP2 copies its input into its own place: a check
            mine.copy_(input_tensor.view(-1))
        dist.barrier(group=group)
        return None


class ShmReduceScatter(ReduceScatter):
    """`output` = the sum over ranks of their `input`'s chunk number `rank`, each input in its rank's shared segment."""

    def __init__(self, group: dist.ProcessGroup, fallback: ReduceScatter, max_numel: int):
        self.group, self.fallback = group, fallback
        self.segments = _Segments(group, 1, per_rank=True, what="FSDP's reduce-scatters", max_numel=max_numel)
        self.inputs: dict[int, list[torch.Tensor]] = {}  # input data pointer -> every rank's input, same place
        self._next_is_input = True

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # FSDP2 asks twice per reduce-scatter: its input (every rank's whole unit), then its output (one chunk).
        is_input, self._next_is_input = self._next_is_input, not self._next_is_input
        numel = int(torch.Size(size).numel())
        slot = self.segments.take(numel, dtype) if is_input and device.type == "cpu" else None
        if slot is None:
            return torch.empty(*size, dtype=dtype, device=device)
        views = [seg[: numel * dtype.itemsize].view(dtype).view(*size) for seg in slot]
        mine = views[self.group.rank()]
        self.inputs = {mine.data_ptr(): views}
        return mine

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> None:
        views = self.inputs.pop(input_tensor.data_ptr(), None)
        if views is None:
            return self.fallback(output_tensor, input_tensor, group, op, async_op)
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"ShmReduceScatter sums only (install() forces sum reduction), got {op}")
        rank, world = group.rank(), group.size()
        dist.barrier(group=group)  # every rank's input is written
        chunks = [v.view(world, -1)[rank] for v in views]
        torch.add(chunks[0], chunks[1], out=output_tensor.view(-1)) if world > 1 else output_tensor.copy_(chunks[0])
        for c in chunks[2:]:
            output_tensor.view(-1).add_(c)
        dist.barrier(group=group)  # every rank has read: the segments may be written again
        return None


def _padded(p: torch.Tensor, world: int) -> int:
    """A weight's elements as FSDP2 gathers them: its rows padded to a multiple of the ranks."""
    if p.dim() == 0:
        return 1
    rows = p.shape[0]
    return -(-rows // world) * world * (p.numel() // max(rows, 1))


_COMMS: dict[tuple[int, ...], tuple[ShmAllGather, ShmReduceScatter]] = {}


def install(units: list[FSDPModule], blocks: list[FSDPModule], group: dist.ProcessGroup) -> None:
    """Make every FSDP2 unit gather and reduce through shared memory where it is one of `blocks`, by pairwise
    exchanges otherwise (the root) and where shared memory is refused.

    One pair of comms per set of ranks in the process: every unit of every model (actor, reference, critic) shares
    their rings, which then hold the largest block of them all; the ranks issue FSDP2's collectives in one order,
    so the rings' turns agree between them."""
    world = group.size()
    largest = max((sum(_padded(p, world) for p in b.parameters()) for b in blocks), default=0)
    key = tuple(dist.get_process_group_ranks(group))
    if key not in _COMMS:
        _COMMS[key] = (ShmAllGather(group, gloo_comms.PairwiseAllGather(), largest),
                       ShmReduceScatter(group, gloo_comms.PairwiseReduceScatter(), largest))
    gather, reduce = _COMMS[key]
    for comm in (gather, reduce):
        comm.segments.max_numel = max(comm.segments.max_numel, largest)
    for unit in units:
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(reduce)
        unit.set_force_sum_reduction_for_comms(True)
