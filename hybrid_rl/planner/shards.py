"""Bytes one rank holds for one model under FSDP2: padded parameter shards, gradients, optimizer state."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_rl.model.optimizers import OPTIMIZERS
from hybrid_rl.planner.param_count import ParamShape


@dataclass(frozen=True)
class ShardBytes:
    """Bytes one rank holds for one model under FSDP2 (world 1 = the plain model)."""

    params: int  # stored shards (float32 master weights unless frozen), dim 0 padded to a multiple of the world
    grads: int  # float32, padded like the params (views into FSDP's reduce-scatter output); trainable only
    optim: int  # the moments of the unpadded local shard (`model/optimizers.py`) + a float32 `step` per trainable tensor


def shard_rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """(padded rows, real rows) of FSDP2's Shard(0) for `rank`: chunks of ceil(dim0 / world)."""
    chunk = -(-dim0 // world)
    return chunk, max(0, min(chunk, dim0 - rank * chunk))


def shard_bytes(params: tuple[ParamShape, ...] | list[ParamShape], world: int, rank: int = 0, *,
                param_bytes: int = 4, frozen_bytes: int | None = None, optimizer: str = "adamw") -> ShardBytes:
    """`frozen_bytes`: storage of the parameters that do not train (a LoRA base); None = `param_bytes`.
    `optimizer`: an `optim.name`; its state is counted per trainable tensor (8-bit moments depend on each size)."""
    state_bytes = OPTIMIZERS[optimizer].state_bytes
    stored = trained_padded = moments = 0
    for p in params:
        dim0 = p.shape[0] if p.shape else 1
        rest = p.numel // dim0 if dim0 else 0
        pad_rows, real_rows = shard_rows(dim0, world, rank)
        stored += pad_rows * rest * (param_bytes if p.trainable or frozen_bytes is None else frozen_bytes)
        if p.trainable:
            trained_padded += pad_rows * rest
            moments += state_bytes(real_rows * rest)
    steps = sum(p.trainable for p in params)
    return ShardBytes(params=stored, grads=4 * trained_padded, optim=moments + 4 * steps)
