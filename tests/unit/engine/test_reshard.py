"""Resharding on real gloo ranks (no vLLM): each rank gets exactly its TP slice and checksums agree."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.weightsync.layout import Layout, ModelDims
from hybrid_rl.weightsync.reshard import (
    SourceParam,
    SyncStats,
    block_checksum,
    build_plan,
    checksums_match,
    fsdp_row_ranges,
    probe_for,
    stream_buckets,
    stream_slices,
)

DIMS = ModelDims("LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=96, num_heads=2,
                 num_kv_heads=1, head_dim=32, tie_word_embeddings=False)


def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (100, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.k_proj.weight": (32, 64),
        "model.layers.0.self_attn.v_proj.weight": (32, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, 64),
        "model.layers.0.mlp.gate_proj.weight": (96, 64),
        "model.layers.0.mlp.up_proj.weight": (96, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 96),
        "model.layers.0.input_layernorm.weight": (64,),
        "model.norm.weight": (64,),
        "lm_head.weight": (100, 64),
    }
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


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
                         **_row_landed(rank, world, tp, full, sources, layout))
    dist.destroy_process_group()


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


def test_one_rank_hands_on_the_cast_bytes_without_assembling_a_copy():
    """World 1 (one rank using every core, or one GPU): each weight arrives as one piece, so the slices handed to vLLM
    are views of the bucket's cast buffer (no second copy), with the same values and checksums as at world 4."""
    full = full_weights()
    sources = [SourceParam(n, w, tuple(w.shape)) for n, w in full.items()]
    plan = build_plan(sources, Layout(DIMS, 1), rank=0, world=1, tp_rank_of=lambda r: 0, bucket_bytes=8 * 1024,
                      dtype=torch.bfloat16, sharded=True)
    storages, sums = {}, []
    for k, pairs in stream_buckets(plan, sources, device=torch.device("cpu"), probe_cols=16):
        for ts, tensor in pairs:
            assert torch.equal(tensor, full[ts.hf_name].to(torch.bfloat16)), ts.hf_name
            storages.setdefault(k, set()).add(tensor.untyped_storage().data_ptr())
            cols = probe_for(ts, 16, 0)
            sums.append(block_checksum(tensor if cols is None else tensor[:, cols], row0=0, col_ids=cols))
    assert len(storages) == len(plan.buckets) > 3
    assert all(len(ptrs) == 1 for ptrs in storages.values()), "a bucket's slices were copied out of its buffer"
    assert bool(checksums_match(plan.expected, torch.stack(sums)).all())


def test_one_rank_with_a_casting_landing_hands_on_the_sources_themselves():
    """World 1, `row_landing` (the in-place paths cast as they copy): the slices are the trainer's float32 matrices
    themselves (no buffer, no cast before the landing), and the checksums are those of their bf16 values, the
    values that land: the same as the cast path's."""
    full = full_weights()
    sources = [SourceParam(n, w, tuple(w.shape)) for n, w in full.items()]

    def stream(row_landing):
        plan = build_plan(sources, Layout(DIMS, 1), rank=0, world=1, tp_rank_of=lambda r: 0, bucket_bytes=8 * 1024,
                          dtype=torch.bfloat16, sharded=True)
        stats = SyncStats()
        pairs = list(stream_slices(plan, sources, device=torch.device("cpu"), probe_cols=16, stats=stats,
                                   row_landing=row_landing))
        return plan, stats, pairs

    plan, stats, pairs = stream(True)
    cast_plan, cast_stats, cast_pairs = stream(False)
    assert [ts for ts, _ in pairs] == [ts for ts, _ in cast_pairs]
    for (ts, tensor), (_, cast) in zip(pairs, cast_pairs, strict=True):
        if tensor.dim() == 2:  # vectors (biases, norms) are cast here: vLLM may keep them in float32
            assert tensor.untyped_storage().data_ptr() == full[ts.hf_name].untyped_storage().data_ptr(), ts.hf_name
        else:
            assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor.to(torch.bfloat16), cast)
    assert torch.equal(plan.expected, cast_plan.expected)
    assert (stats.bytes_received, stats.buckets) == (cast_stats.bytes_received, cast_stats.buckets)
    assert stats.peak_buffer_bytes == 0 < cast_stats.peak_buffer_bytes


def test_probed_columns_are_adjacent_bands_that_cover_every_column_in_turn():
    from hybrid_rl.weightsync.reshard import probe_columns, take_columns

    for ncols, max_cols in ((896, 32), (100, 32), (20, 32), (4864, 32), (7, 3)):
        bands = [probe_columns(ncols, max_cols, i) for i in range(-(-ncols // max_cols))]
        assert torch.equal(torch.cat(bands), torch.arange(ncols))  # each column once, in ceil(ncols / max) syncs
        assert all(0 < len(b) <= max_cols for b in bands)
        assert torch.equal(probe_columns(ncols, max_cols, len(bands)), bands[0])  # then around again
    x = torch.randn(6, 40)
    for cols in (probe_columns(40, 16, 1), torch.tensor([1, 5, 6])):
        assert torch.equal(take_columns(x, cols), x[:, cols])
    assert take_columns(x, probe_columns(40, 16, 1)).data_ptr() == x[:, 16:].data_ptr()  # a band is a view


def test_a_band_checksummed_in_blocks_sees_every_row_and_rounds_as_the_landing_will():
    """`block_checksum` over a vocabulary-sized band works block by block: every block's rows count, at their
    place; `dtype` rounds the sender's float32 values as the landing casts them."""
    g = torch.Generator().manual_seed(0)
    band = torch.randn(7000, 96, generator=g)[:, 32:64]  # strided, like a probed band; 3+ blocks of 2048 rows
    cols = torch.arange(32, 64)
    landed = band.to(torch.bfloat16)
    want = block_checksum(landed, row0=5, col_ids=cols)
    assert checksums_match(block_checksum(band, row0=5, col_ids=cols, dtype=torch.bfloat16), want)
    assert not checksums_match(block_checksum(band, row0=5, col_ids=cols), want)  # unrounded values differ
    for row in (0, 2047, 2048, 6999):  # a change in any block, first and last rows included
        changed = landed.clone()
        changed[row, 7] += 1
        assert not checksums_match(block_checksum(changed, row0=5, col_ids=cols), want), row
    swapped = landed.clone()
    swapped[[4000, 4001]] = landed[[4001, 4000]]  # the same values at other rows
    assert not checksums_match(block_checksum(swapped, row0=5, col_ids=cols), want)
