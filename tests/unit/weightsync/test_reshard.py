"""Resharding in one process (no vLLM): the slices, buffers and checksums of one rank, and the column probes.
(On 4 gloo ranks: tests/integration/weightsync/test_reshard_ranks.py.)"""

import torch

from hybrid_rl.weightsync.layout import Layout, ModelDims
from hybrid_rl.weightsync.plan import SourceParam, build_plan
from hybrid_rl.weightsync.reshard import SyncStats, stream_buckets, stream_slices
from hybrid_rl.weightsync.verify import block_checksum, checksums_match, probe_for

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


def test_a_plan_is_local_only_where_every_rank_holds_what_its_vllm_needs():
    """`ReshardPlan.local` (no send buffer, no collective in the sync): one rank, or shard size 1 at any world and TP;
    never where a weight is split over ranks."""
    full = full_weights()

    def plan(world, tp, shard, rank=0):
        rows = {n: (0, w.shape[0]) if shard == 1 else (0, -(-w.shape[0] // shard)) for n, w in full.items()}
        sources = [SourceParam(n, w[slice(*rows[n])], tuple(w.shape)) for n, w in full.items()]
        return build_plan(sources, Layout(DIMS, tp), rank=rank, world=world, tp_rank_of=lambda r: r % tp,
                          bucket_bytes=8 * 1024, dtype=torch.bfloat16, sharded=True, shard=shard)

    assert plan(1, 1, 1).local
    assert all(plan(4, tp, 1, rank).local for tp in (1, 2) for rank in range(4))
    assert not any(plan(4, tp, shard, rank).local for tp in (1, 2) for shard in (2, 4) for rank in range(4))


def test_probed_columns_are_adjacent_bands_that_cover_every_column_in_turn():
    from hybrid_rl.weightsync.verify import probe_columns, take_columns

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
