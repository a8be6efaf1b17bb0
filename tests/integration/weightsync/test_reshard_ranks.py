"""Resharding on real gloo ranks (no vLLM, 4 spawned processes): each rank gets exactly its TP slice and
checksums agree, on the colocated plan, the row-landing plan and the sidecar's writers-only plan."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.distributed.shm_exchange import ShmExchange
from hybrid_rl.utils.shm import SHM_DIR
from hybrid_rl.weightsync.layout import Layout
from hybrid_rl.weightsync.plan import SourceParam, build_plan, fsdp_row_ranges
from hybrid_rl.weightsync.reshard import shared_exchange, stream_buckets, stream_slices
from hybrid_rl.weightsync.verify import block_checksum, checksums_match, probe_for
from tests.unit.weightsync.test_reshard import DIMS, full_weights


def _worker(rank: int, world: int, tp: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    full = full_weights()
    layout = Layout(DIMS, tp)
    sources = []
    for name, w in full.items():  # FSDP2's Shard(0): rank r holds rows [r*c, (r+1)*c)
        a, b = fsdp_row_ranges(w.shape[0], world)[rank]
        sources.append(SourceParam(name, w[a:b].clone(), tuple(w.shape)))
    plan = build_plan(sources, layout, rank=rank, world=world, tp_rank_of=lambda r: r % tp,
                      bucket_bytes=8 * 1024, dtype=torch.bfloat16, sharded=True)
    exact, got = True, {}
    for ts, tensor in stream_slices(plan, sources, device=torch.device("cpu"), probe_cols=16):
        want = full[ts.hf_name] if ts.dim is None else full[ts.hf_name].narrow(ts.dim, ts.start, ts.stop - ts.start)
        exact &= torch.equal(tensor, want.to(torch.bfloat16))
        got[ts.hf_name] = (ts, tensor)
    sums = torch.stack([block_checksum(t if probe_for(ts, 16, 0) is None else t[:, probe_for(ts, 16, 0)], row0=0,
                                       col_ids=probe_for(ts, 16, 0)) for ts, t in got.values()])
    results[rank] = dict(exact=exact, checksums_ok=bool(checksums_match(plan.expected, sums).all()),
                         buckets=len(plan.buckets), received=plan.bytes_per_sync, **_writers_only(rank, world, tp, full,
                                                                                                   sources, layout),
                         **_row_landed(rank, world, tp, full, sources, layout), **_hsdp(rank, world, tp, full, layout),
                         **_shared_memory(rank, world, tp, full, sources, layout))
    dist.destroy_process_group()


def _hsdp(rank: int, world: int, tp: int, full, layout) -> dict:
    """HSDP (`trainer.shard_size`): 2 replicas each sharded over 2 ranks, and shard size 1 (every rank whole). Each
    rank gets its slice from its own replica only (every byte once), exactly, with the senders' checksums."""
    out = {}
    for shard in (2, 1):
        sources = []
        for name, w in full.items():  # rank r is replica r // shard holding shard r % shard (`fsdp_mesh`)
            a, b = fsdp_row_ranges(w.shape[0], shard)[rank % shard]
            sources.append(SourceParam(name, w[a:b].clone(), tuple(w.shape)))
        plan = build_plan(sources, layout, rank=rank, world=world, tp_rank_of=lambda r: r % tp,
                          bucket_bytes=8 * 1024, dtype=torch.bfloat16, sharded=True, shard=shard)
        exact, sums = True, []
        for ts, tensor in stream_slices(plan, sources, device=torch.device("cpu"), probe_cols=16):
            exact &= torch.equal(tensor, (full[ts.hf_name] if ts.dim is None else full[ts.hf_name].narrow(
                ts.dim, ts.start, ts.stop - ts.start)).to(torch.bfloat16))
            cols = probe_for(ts, 16, 0)
            sums.append(block_checksum(tensor if cols is None else tensor[:, cols], row0=0, col_ids=cols))
        peers = {pc.src for b in plan.buckets for per_src in b.recvs for pc in per_src}
        out[f"hsdp{shard}"] = (exact, bool(checksums_match(plan.expected, torch.stack(sums)).all()),
                               peers <= set(range(rank // shard * shard, rank // shard * shard + shard)),
                               plan.bytes_per_sync)
    out["hsdp1_local"] = _local_row_landing(sources, layout, rank, world, tp, full)
    return out


def _local_row_landing(sources, layout, rank: int, world: int, tp: int, full) -> tuple[bool, bool, bool, bool]:
    """Shard size 1 with a landing that casts (`row_landing`): the plan is local, so every matrix comes as a view of
    the rank's own weight, uncast (no send buffer, no all-to-all), and still lands exactly with the checksums."""
    plan = build_plan(sources, layout, rank=rank, world=world, tp_rank_of=lambda r: r % tp,
                      bucket_bytes=8 * 1024, dtype=torch.bfloat16, sharded=True, shard=1)
    own = {s.tensor().untyped_storage().data_ptr() for s in sources}
    exact, views, sums = True, True, []
    for ts, tensor in stream_slices(plan, sources, device=torch.device("cpu"), probe_cols=16, row_landing=True):
        want = full[ts.hf_name] if ts.dim is None else full[ts.hf_name].narrow(ts.dim, ts.start, ts.stop - ts.start)
        landed = tensor.to(torch.bfloat16)
        exact &= torch.equal(landed, want.to(torch.bfloat16))
        if tensor.dim() == 2:
            views &= tensor.untyped_storage().data_ptr() in own
        cols = probe_for(ts, 16, 0)
        sums.append(block_checksum(landed if cols is None else landed[:, cols], row0=0, col_ids=cols))
    return plan.local, exact, views, bool(checksums_match(plan.expected, torch.stack(sums)).all())


def _row_landed(rank: int, world: int, tp: int, full, sources, layout) -> dict:
    """`row_landing` (the in-place paths): the received pieces come unassembled, each at its own first row; written
    at their rows they rebuild every slice exactly, each bucket's pieces in the one receive buffer every bucket reuses."""
    plan = build_plan(sources, layout, rank=rank, world=world, tp_rank_of=lambda r: r % tp,
                      bucket_bytes=8 * 1024, dtype=torch.bfloat16, sharded=True)
    first_row = {ts.hf_name: ts.dest_offset for ts in plan.slices}
    landed = {ts.hf_name: torch.full(ts.shape, float("nan"), dtype=torch.bfloat16) for ts in plan.slices}
    items, buffers = 0, set()
    for ts, tensor in stream_slices(plan, sources, device=torch.device("cpu"), probe_cols=16, row_landing=True):
        landed[ts.hf_name].narrow(0, ts.dest_offset - first_row[ts.hf_name], tensor.shape[0]).copy_(tensor)
        items += 1
        buffers.add(tensor.untyped_storage().data_ptr())
    exact = all(torch.equal(landed[ts.hf_name], (full[ts.hf_name] if ts.dim is None else full[ts.hf_name].narrow(
        ts.dim, ts.start, ts.stop - ts.start)).to(torch.bfloat16)) for ts in plan.slices)
    return dict(r_exact=exact, r_items=items, r_slices=len(plan.slices), r_buffers=len(buffers),
                r_buckets=len(plan.buckets))


def _shared_memory(rank: int, world: int, tp: int, full, sources, layout) -> dict:
    """The row landing with the buckets through shared memory (`rollout.cpu_shm_sync`): three syncs of other
    weights each (both slots written, then one rewritten), every piece read in place from its sender's slot; ranks
    of one TP rank (0 and 2, 1 and 3) need the same pieces, which each sender writes once."""
    plan = build_plan(sources, layout, rank=rank, world=world, tp_rank_of=lambda r: r % tp,
                      bucket_bytes=8 * 1024, dtype=torch.bfloat16, sharded=True)
    exchange = shared_exchange(plan)
    told, exchange_parts = [], exchange.exchange

    def recorded(send, parts, recv_splits):
        told.append(list(parts))
        return exchange_parts(send, parts, recv_splits)

    exchange.exchange = recorded
    first_row = {ts.hf_name: ts.dest_offset for ts in plan.slices}
    exact, checksums, in_place = True, True, True
    for k in range(3):
        scaled = [SourceParam(s.name, s.tensor() * (k + 1), s.shape) for s in sources]
        landed = {ts.hf_name: torch.full(ts.shape, float("nan"), dtype=torch.bfloat16) for ts in plan.slices}
        for ts, tensor in stream_slices(plan, scaled, device=torch.device("cpu"), probe_cols=16, row_landing=True,
                                        exchange=exchange, sync_index=k):
            landed[ts.hf_name].narrow(0, ts.dest_offset - first_row[ts.hf_name], tensor.shape[0]).copy_(tensor)
            in_place &= any(tensor.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
                            for mine in exchange._slots for s in mine)
        sums = []
        for ts in plan.slices:
            want = (full[ts.hf_name] if ts.dim is None else full[ts.hf_name].narrow(ts.dim, ts.start, ts.stop - ts.start))
            exact &= torch.equal(landed[ts.hf_name], (want * (k + 1)).to(torch.bfloat16))
            cols = probe_for(ts, 16, k)
            t = landed[ts.hf_name]
            sums.append(block_checksum(t if cols is None else t[:, cols], row0=0, col_ids=cols))
        checksums &= bool(checksums_match(plan.expected, torch.stack(sums)).all())
    dist.barrier()
    left = [p.name for p in SHM_DIR.glob("hybrid_rl-shm-*")]
    # Every exchange's (offset, elements) of each destination's part in this rank's slot: ranks 0 and 2 (1 and 3)
    # read one part; some parts are not empty.
    once = all(p[0] == p[2] and p[1] == p[3] for p in told) and any(p[0][1] and p[1][1] for p in told)
    no_room = ShmExchange.create(1 << 50) is None  # more than /dev/shm holds: the all-to-all stays, on every rank
    return dict(s_exact=exact, s_checksums=checksums, s_in_place=in_place, s_left=left, s_sent_once=once,
                s_no_room=no_room)


def _writers_only(rank: int, world: int, tp: int, full, sources, layout) -> dict:
    """The sidecar's plan: only ranks < tp receive (server TP rank r <- trainer rank r), straight into the buffers
    `alloc` hands out (a shared-memory slot in the checkpoint engine); the other ranks only send."""
    plan = build_plan(sources, layout, rank=rank, world=world, tp_rank_of=lambda r: r % tp,
                      bucket_bytes=8 * 1024, dtype=torch.bfloat16, sharded=True, receives=lambda r: r < tp)
    handed = []

    def alloc(k, slices):
        handed.append([torch.empty(ts.shape, dtype=torch.bfloat16) for ts in slices])
        return handed[-1]

    exact, items, sums = True, 0, []
    for _, pairs in stream_buckets(plan, sources, device=torch.device("cpu"), probe_cols=16, alloc=alloc):
        for (ts, tensor), given in zip(pairs, handed[-1] if pairs else [], strict=True):
            want = full[ts.hf_name] if ts.dim is None else full[ts.hf_name].narrow(ts.dim, ts.start, ts.stop - ts.start)
            exact &= torch.equal(tensor, want.to(torch.bfloat16)) and tensor.data_ptr() == given.data_ptr()
            cols = probe_for(ts, 16, 0)
            sums.append(block_checksum(tensor if cols is None else tensor[:, cols], row0=0, col_ids=cols))
            items += 1
    ok = rank >= tp or bool(checksums_match(plan.expected, torch.stack(sums)).all())
    return dict(w_exact=exact, w_items=items, w_allocs=len(handed), w_received=plan.bytes_per_sync, w_checksums=ok)


def test_every_rank_receives_exactly_its_tp_slice_from_fsdp_shards():
    world, tp = 4, 2
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, tp, free_port(), results), nprocs=world, join=True)
    full_bytes = sum(w.numel() for w in full_weights().values()) * 2  # bf16
    for r in range(world):
        assert results[r]["exact"], f"rank {r} assembled a wrong slice"
        assert results[r]["checksums_ok"], f"rank {r}: sender checksums disagree with the received slices"
        assert results[r]["r_exact"], f"rank {r}: pieces landed at their rows do not rebuild the slices"
        assert results[r]["r_items"] > results[r]["r_slices"], "no slice came in pieces: nothing tested"
        assert results[r]["r_buffers"] == 1 < results[r]["r_buckets"], "a receive buffer made for each bucket"
        assert results[r]["buckets"] > 3  # bucketed, not one transfer
        # Only the TP slice arrives (about half the model at tp=2; KV head and norms are replicated).
        assert results[r]["received"] < 0.62 * full_bytes
        # Writers only (sidecar): ranks 0..tp-1 get their slice, assembled in the buffers handed out; the rest nothing.
        writer = r < tp
        assert results[r]["w_exact"] and results[r]["w_checksums"], f"rank {r}: writers-only plan"
        assert (results[r]["w_items"] == len(full_weights())) == writer and (results[r]["w_items"] == 0) != writer
        assert (results[r]["w_allocs"] > 0) == writer
        assert results[r]["w_received"] == (results[r]["received"] if writer else 0)
        for shard in (2, 1):
            exact, checksums, own_replica, received = results[r][f"hsdp{shard}"]
            assert exact and checksums and own_replica, f"rank {r}, HSDP shard size {shard}"
            assert received == results[r]["received"], "HSDP receives a replica's bytes more than once"
        assert results[r]["s_exact"] and results[r]["s_checksums"], f"rank {r}: through shared memory"
        assert results[r]["s_in_place"], f"rank {r}: a piece was copied out of its sender's slot"
        assert results[r]["s_sent_once"], f"rank {r}: ranks of one TP rank were written the same pieces twice"
        assert results[r]["s_no_room"], f"rank {r}: an exchange larger than /dev/shm was made"
        assert results[r]["s_left"] == [], f"shared-memory files left: {results[r]['s_left']}"
        local, exact, views, checksums = results[r]["hsdp1_local"]
        assert local and exact and checksums, f"rank {r}: shard size 1, landing rows: {results[r]['hsdp1_local']}"
        assert views, f"rank {r}: shard size 1 copied its own weights into a buffer instead of handing on views"
