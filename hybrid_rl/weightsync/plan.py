"""The resharding plan: which rows of each FSDP2 shard every rank sends to every other, bucket by bucket.

FSDP2 shards every weight along dim 0 over the shard ranks (rank r holds rows [r*c, (r+1)*c), c = ceil(N/W)); vLLM's
TP rank t needs a column block, a row block, a vocab block or the whole tensor (`layout.TPSlice`). A `Piece` is the
intersection of what one rank holds with what another needs; a `Bucket` groups the pieces of a few weights (at most
`rollout.bucket_mb`), which `reshard.stream_buckets` moves in one exchange. The plan is computed the same on every
rank, from shapes alone: no collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybrid_rl.weightsync.layout import Layout, TPSlice


@dataclass(frozen=True)
class SourceParam:
    """One trainable weight as this rank holds it: a dim-0 shard (FSDP2) or the full tensor.

    `local` may be a function that computes it (e.g. a LoRA layer's merged weight, whose computation
    gathers the adapter: a collective): it is called when the weight's bucket is sent, on every rank in
    the bucket's order, and dropped after it, so a sync never holds more than a bucket of computed weights.
    """

    name: str
    local: torch.Tensor | Callable[[], torch.Tensor]
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        return self.local if isinstance(self.local, torch.Tensor) else self.local()


def fsdp_row_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """Rows each rank holds under FSDP2's Shard(0) (torch.chunk semantics: ceil-sized chunks)."""
    c = -(-rows // world)
    return [(min(r * c, rows), min((r + 1) * c, rows)) for r in range(world)]


def replica_peers(rank: int, world: int, shard: int) -> range:
    """The ranks that together hold one whole copy of every weight with `rank` (`distributed.mesh.fsdp_mesh`: rank r
    is replica r // shard, shard r % shard). A rank's slices come from these only: every other replica holds the same
    rows, so each byte is sent once. shard = world: everyone; shard = 1: the rank alone (each takes its own slice)."""
    first = rank // shard * shard
    return range(first, first + shard)


@dataclass(frozen=True)
class Piece:
    """The part of weight `index` that rank `src` sends to rank `dst`.

    `rows` are the source-local rows, `cols` the full-tensor columns (every piece spans the whole
    width of the destination slice); `slice_row0` is the block's first row inside that slice and
    `slice_ncols` the slice's width (None for 1-D weights).
    """

    index: int
    src: int
    dst: int
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    slice_row0: int
    slice_ncols: int | None

    @property
    def shape(self) -> tuple[int, ...]:
        r = self.rows[1] - self.rows[0]
        return (r,) if self.cols is None else (r, self.cols[1] - self.cols[0])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _piece(index: int, ts: TPSlice, src: int, dst: int, held: tuple[int, int], sharded: bool) -> Piece | None:
    """Intersection of the rows `src` holds with the slice `dst` needs (None when empty)."""
    a, b = held
    off = a if sharded else 0
    full_cols = None if len(ts.full_shape) == 1 else (0, ts.full_shape[1])
    width = None if full_cols is None else ts.shape[1]
    if ts.dim == 0:
        lo, hi = max(a, ts.start), min(b, ts.stop)
        if lo >= hi:
            return None
        return Piece(index, src, dst, (lo - off, hi - off), full_cols, lo - ts.start, width)
    if a >= b:
        return None
    cols = (ts.start, ts.stop) if ts.dim == 1 else full_cols
    return Piece(index, src, dst, (a - off, b - off), cols, a, width)


@dataclass
class Bucket:
    """Weights moved by one all-to-all, with this rank's send/receive pieces precomputed."""

    indices: list[int]
    sends: list[list[Piece]]  # per destination rank
    recvs: list[list[Piece]]  # per source rank
    recv_bytes: int = 0


@dataclass
class ReshardPlan:
    """Everything about a sync that depends only on shapes: computed once, reused every step."""

    slices: list[TPSlice]  # this rank's slice of each weight, in source order
    buckets: list[Bucket]
    dtype: torch.dtype
    rank: int
    world: int
    bytes_per_sync: int = 0
    # Shard size 1 (one rank, or every rank holding each weight whole): each rank's pieces are its own and it sends to
    # no one, so nothing moves between ranks. The same on every rank, as it must be: it decides the collectives.
    local: bool = False
    # Senders' checksums of this rank's slices, filled in at the end of each `stream_slices`.
    expected: torch.Tensor | None = field(default=None, repr=False)


def build_plan(
    params: list[SourceParam], layout: Layout, *, rank: int, world: int, tp_rank_of: Callable[[int], int],
    bucket_bytes: int, dtype: torch.dtype, sharded: bool, receives: Callable[[int], bool] | None = None,
    shard: int | None = None,
) -> ReshardPlan:
    """Plan the pieces this rank sends and receives, grouped in buckets of about `bucket_bytes` received.

    Weights of one vLLM module (q/k/v -> qkv_proj, gate/up -> gate_up_proj) stay in one bucket: vLLM
    processes a fused layer only once all its parts have arrived. `receives(rank)` False: that rank
    only sends (the sidecar's checkpoint engine: only one rank per server TP rank writes its slices);
    None: every rank receives its TP slice (colocated). `shard`: ranks each sharded weight is split over (HSDP's
    shard size; None = the world); not `sharded` is the same as shard 1.
    """
    shard = (shard or world) if sharded else 1
    if world % shard:
        raise ValueError(f"shard size {shard} does not divide the world ({world})")
    elt = torch.empty((), dtype=dtype).element_size()
    slices = [layout.slice(p.name, p.shape, tp_rank_of(rank)) for p in params]
    # Bucket boundaries must be the same on every rank (each bucket is one collective), so they are
    # set by the largest slice any TP rank holds, not by this rank's (vocab slices differ in size).
    tp = layout.tp
    size = [max(layout.slice(p.name, p.shape, t).numel for t in range(tp)) for p in params]
    groups: list[list[int]] = []
    for i, ts in enumerate(slices):
        if groups and slices[groups[-1][-1]].module == ts.module:
            groups[-1].append(i)
        else:
            groups.append([i])
    buckets: list[Bucket] = []
    current: list[int] = []
    for g in groups:
        if current and sum(size[i] for i in current + g) * elt > bucket_bytes:
            buckets.append(_bucket(current, params, layout, rank, world, tp_rank_of, shard, elt, receives))
            current = []
        current += g
    if current:
        buckets.append(_bucket(current, params, layout, rank, world, tp_rank_of, shard, elt, receives))
    plan = ReshardPlan(slices, buckets, dtype, rank, world, local=shard == 1)
    plan.bytes_per_sync = sum(b.recv_bytes for b in buckets)
    return plan


def _bucket(indices, params, layout, rank, world, tp_rank_of, shard, elt, receives) -> Bucket:
    sends: list[list[Piece]] = [[] for _ in range(world)]
    recvs: list[list[Piece]] = [[] for _ in range(world)]
    receives = receives or (lambda r: True)
    # Unsharded weights (shard 1) are whole on every rank: each rank just takes its own slice locally.
    peers = replica_peers(rank, world, shard)
    sharded = shard > 1
    for i in indices:
        p = params[i]
        ranges = (layout.held_rows(p.name, p.shape, shard) or fsdp_row_ranges(p.shape[0], shard)) if sharded \
            else [(0, p.shape[0])]
        held = [ranges[r % shard] for r in range(world)]
        mine = layout.slice(p.name, p.shape, tp_rank_of(rank))
        for other in peers:
            theirs = layout.slice(p.name, p.shape, tp_rank_of(other))
            if receives(other) and (piece := _piece(i, theirs, rank, other, held[rank], sharded)):  # my rows ∩ theirs
                sends[other].append(piece)
            if receives(rank) and (piece := _piece(i, mine, other, rank, held[other], sharded)):  # their rows ∩ mine
                recvs[other].append(piece)
    recv_bytes = pieces_numel(recvs) * elt
    return Bucket(list(indices), sends, recvs, recv_bytes)


def pieces_numel(pieces: list[list[Piece]]) -> int:
    return sum(pc.numel for per_rank in pieces for pc in per_rank)
