"""FSDP2's all-gather and reduce-scatter over gloo, as pairwise sends and receives.

On a CPU world (gloo) FSDP2's collectives are most of what two ranks pay over one: gloo's own
`all_gather_into_tensor` and `reduce_scatter_tensor` move a 0.5B model's bf16 weights and fp32
gradients at well under half the speed of gloo's point-to-point path between the same two processes
(2 ranks, one thread each, runtime defaults, a whole 0.5B model's worth: all-gather bf16 0.54 s and
reduce-scatter fp32 1.54 s with gloo's collectives, 0.26 s and 0.51 s with these classes). These
classes plug into FSDP2's own extension point (`FSDPModule.set_custom_all_gather` /
`set_custom_reduce_scatter`) and do the same collectives as direct exchanges between every pair of
ranks; NCCL worlds keep FSDP2's defaults (`install`'s caller decides).

The reduce-scatter runs world - 1 rounds: in round k a rank sends peer (rank + k)'s chunk and receives
its own chunk from peer (rank - k), adding it into the output. The first round receives into the output
itself and later ones into one buffer of a chunk's size (a world of 8 does not hold 7 chunks at once;
a world of 2 holds none). It sums only: `install` asks FSDP2 to divide after the sum
(`set_force_sum_reduction_for_comms`) instead of passing gloo's AVG.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _Empty:
    """FSDP2 asks a comm for its buffers; plain host tensors are what gloo sends."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def _exchange(ops: list[dist.P2POp]) -> None:
    for work in dist.batch_isend_irecv(ops):
        work.wait()


class PairwiseAllGather(_Empty, AllGather):
    """`output` = every rank's `input`, in rank order; each rank receives straight into its slice."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        rank, world, n = group.rank(), group.size(), input_tensor.numel()
        chunks = output_tensor.view(world, n)
        if chunks[rank].data_ptr() != input_tensor.data_ptr():  # FSDP2 copies its input into its own slot
            chunks[rank].copy_(input_tensor.view(-1))
        ops = []
        for k in range(1, world):
            peer = (rank + k) % world
            ops.append(dist.P2POp(dist.isend, input_tensor.view(-1), dist.get_global_rank(group, peer), group))
            ops.append(dist.P2POp(dist.irecv, chunks[peer], dist.get_global_rank(group, peer), group))
        _exchange(ops)
        return None  # done: FSDP2 waits on nothing


class PairwiseReduceScatter(_Empty, ReduceScatter):
    """`output` = the sum over ranks of their `input`'s chunk number `rank`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"PairwiseReduceScatter sums only (install() forces sum reduction), got {op}")
        rank, world = group.rank(), group.size()
        chunks = input_tensor.view(world, -1)
        received = output_tensor  # round 1 receives straight into the output; a buffer only from round 2
        for k in range(1, world):
            to, frm = (rank + k) % world, (rank - k) % world
            _exchange([dist.P2POp(dist.isend, chunks[to], dist.get_global_rank(group, to), group),
                       dist.P2POp(dist.irecv, received, dist.get_global_rank(group, frm), group)])
            if k == 1:
                output_tensor.add_(chunks[rank])
                received = torch.empty_like(output_tensor) if world > 2 else None
            else:
                output_tensor.add_(received)
        if world == 1:
            output_tensor.copy_(chunks[0])
        return None


class OneRankReduceScatter(ReduceScatter):
    """The reduce-scatter of a shard group of one rank (HSDP at `trainer.shard_size=1`): no copy.

    There FSDP2 never calls the comm; it asks for an input (the unit's gradients, copied in) and an output of the
    same size, copies the one into the other and all-reduces the output over the replicas. Handing out the input
    itself as the output makes that copy a no-op (`copy_` of a tensor onto its own memory returns at once), where
    it was a write of a unit's float32 gradients into fresh pages: 6-24 ms a block of the 25M model on CPU.
    """

    def __init__(self) -> None:
        self._input: torch.Tensor | None = None  # asked first; the output is asked next, of the same size
        self.aliased = 0  # outputs handed out as their input (a test reads it)

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        given, self._input = self._input, None
        if given is not None and given.dtype == dtype and given.numel() == torch.Size(size).numel():
            self.aliased += 1
            return given.view(*size)
        self._input = torch.empty(*size, dtype=dtype, device=device)
        return self._input

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> None:
        if group.size() != 1:
            raise ValueError(f"OneRankReduceScatter serves a shard group of one rank, got {group.size()}")
        output_tensor.copy_(input_tensor)  # a no-op when FSDP2 took the output from allocate()


def install(module: FSDPModule, *, one_rank: bool = False) -> None:
    """Make one FSDP2 unit gather and reduce with the pairwise comms (sum, then FSDP2's own divide); `one_rank`:
    its weights are whole on every rank (a shard group of one), whose reduce-scatter needs no second buffer."""
    module.set_custom_all_gather(PairwiseAllGather())
    module.set_custom_reduce_scatter(OneRankReduceScatter() if one_rank else PairwiseReduceScatter())
    module.set_force_sum_reduction_for_comms(True)
