"""A sync's work per bucket does not grow with its number of weights (`weightsync/grouped.py`): the operations the
resharder and the in-place landing dispatch for one bucket, and the verification's read-back, counted with a
TorchDispatchMode, are the same for a bucket of 9 weights and one of 72; the values landed and the checksums are
those of the per-weight code."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_rl.weightsync.grouped import slice_digest
from hybrid_rl.weightsync.layout import Layout, ModelDims
from hybrid_rl.weightsync.plan import SourceParam, build_plan
from hybrid_rl.weightsync.reshard import stream_buckets
from hybrid_rl.weightsync.verify import block_checksum, checksums_match, probe_for
from hybrid_rl.weightsync.vllm_weights import load_inplace, readback

H, FF = 64, 96  # hidden, intermediate
PER_LAYER = {"self_attn.q_proj.weight": (H, H), "self_attn.k_proj.weight": (32, H), "self_attn.v_proj.weight": (32, H),
             "self_attn.o_proj.weight": (H, H), "mlp.gate_proj.weight": (FF, H), "mlp.up_proj.weight": (FF, H),
             "mlp.down_proj.weight": (H, FF), "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}


class KernelCount(TorchDispatchMode):
    """Operations that do work (launch a kernel on a device); views are metadata only and not counted."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _weights(layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(layers)
    return {f"model.layers.{i}.{n}": torch.randn(s, generator=g) for i in range(layers) for n, s in PER_LAYER.items()}


def _sync(layers: int, *, row_landing: bool, count: bool):
    """One rank, one bucket, the in-place landing into vLLM-shaped (fused qkv / gate_up) bf16 parameters."""
    full = _weights(layers)
    dims = ModelDims("LlamaForCausalLM", vocab_size=100, hidden_size=H, intermediate_size=FF, num_heads=2,
                     num_kv_heads=1, head_dim=32, tie_word_embeddings=False)
    sources = [SourceParam(n, w, tuple(w.shape)) for n, w in full.items()]
    plan = build_plan(sources, Layout(dims, 1), rank=0, world=1, tp_rank_of=lambda r: 0, bucket_bytes=2**30,
                      dtype=torch.bfloat16, sharded=False)
    rows: dict[str, int] = {}
    for ts in plan.slices:
        rows[ts.vllm_name] = max(rows.get(ts.vllm_name, 0), ts.dest_offset + ts.shape[0])
    params = {ts.vllm_name: torch.nn.Parameter(torch.zeros((rows[ts.vllm_name], *ts.shape[1:]), dtype=torch.bfloat16),
                                               requires_grad=False) for ts in plan.slices}
    mode = KernelCount()
    with mode if count else torch.no_grad():
        buckets = stream_buckets(plan, sources, device=torch.device("cpu"), probe_cols=16, sync_index=1,
                                 row_landing=row_landing)
        load_inplace(params, (items for _, items in buckets))
    model = _module_of(params)
    requests = [(ts, probe_for(ts, 16, 1)) for ts in plan.slices]
    read = KernelCount()
    with read if count else torch.no_grad():
        got = readback(model, requests, slice_digest)
    assert bool(checksums_match(plan.expected, got).all()), "the read-back disagrees with the senders' checksums"
    return plan, full, params, mode.ops, read.ops


def _module_of(params: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A stand-in for vLLM's model: the parameters under their dotted names."""
    root = torch.nn.Module()
    for name, p in params.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, p)
    return root


@pytest.mark.parametrize("row_landing", [True, False], ids=["casting-landing", "cast-buffer"])
def test_a_bucket_dispatches_the_same_operations_for_9_or_72_weights(row_landing):
    small, large = (_sync(layers, row_landing=row_landing, count=True) for layers in (1, 8))
    assert len(small[0].slices) == 9 and len(large[0].slices) == 72 and len(large[0].buckets) == 1
    assert sorted(small[3]) == sorted(large[3]), f"{len(small[3])} vs {len(large[3])} operations"
    assert len(large[3]) < 40  # a few per bucket (the per-weight code dispatched 10-20 per weight)
    assert sorted(small[4]) == sorted(large[4]), f"read-back: {len(small[4])} vs {len(large[4])} operations"
    assert len(large[4]) < 15


@pytest.mark.parametrize("row_landing", [True, False], ids=["casting-landing", "cast-buffer"])
def test_grouped_sync_lands_the_cast_values_and_checksums_as_the_per_weight_code(row_landing):
    plan, full, params, _, _ = _sync(3, row_landing=row_landing, count=False)
    landed = []
    for ts in plan.slices:
        region = params[ts.vllm_name].data.narrow(0, ts.dest_offset, ts.shape[0])
        assert torch.equal(region, full[ts.hf_name].to(torch.bfloat16)), ts.hf_name
        cols = probe_for(ts, 16, 1)  # what the verification reads back (`readback`), checked per weight
        landed.append(block_checksum(region if cols is None else region[:, cols], row0=0, col_ids=cols))
    assert bool(checksums_match(plan.expected, torch.stack(landed)).all())
    # Shifted rows are seen: the checksums weigh every row by its position.
    wrong = params["model.layers.0.self_attn.o_proj.weight"].data
    wrong.copy_(wrong.roll(1, 0))
    ts = next(t for t in plan.slices if t.vllm_name == "model.layers.0.self_attn.o_proj.weight")
    cols = probe_for(ts, 16, 1)
    assert not bool(checksums_match(plan.expected[plan.slices.index(ts)],
                                    block_checksum(wrong[:, cols], row0=0, col_ids=cols)))
