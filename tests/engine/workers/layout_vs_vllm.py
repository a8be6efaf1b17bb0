"""Our TP slicing agrees with vLLM's own sharding of the same full weights.

vLLM loads the checkpoint itself (load_format=auto) at the given TP size; for every weight we
read vLLM's local parameter back (exactly, through the packed CPU kernels) and compare it with the
slice `layout.py` computes from the full HF tensor, placed where the in-place path would copy it.
"""

import argparse

import torch
import torch.distributed as dist
from common import write_result
from safetensors.torch import load_file
from transformers import AutoConfig

from hybrid_rl.dist.mesh import init_distributed
from hybrid_rl.engine.layout import Layout, ModelDims
from hybrid_rl.engine.vllm_engine import EngineSpec, VLLMEngine

p = argparse.ArgumentParser()
p.add_argument("--models", nargs="+", required=True)
p.add_argument("--tp", type=int, default=2)
a = p.parse_args()
dims = init_distributed(a.tp)
result = {}
for path in a.models:
    layout = Layout(ModelDims.from_hf_config(AutoConfig.from_pretrained(path)), a.tp)
    full = load_file(f"{path}/model.safetensors")
    names = [n for n in full if not layout.skip(n)]
    slices = [layout.slice(n, tuple(full[n].shape), dims.tp_rank) for n in names]
    engine = VLLMEngine(EngineSpec(model_path=path, tp=a.tp, dtype="float32", max_model_len=128, seed=0,
                                   enforce_eager=True, kv_cache_gb=0.1))
    engine.start()
    # The engine starts from dummy weights: give vLLM's own loader the full tensors (it does its own TP
    # narrowing and fusing), then read its parameters back.
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(full.items())})
    mismatched = []
    for ts in slices:
        cols = None if len(ts.full_shape) == 1 else torch.arange(ts.shape[1])
        mine = full[ts.hf_name].narrow(ts.dim, ts.start, ts.stop - ts.start) if ts.dim is not None else full[ts.hf_name]
        got = engine.readback([(ts, cols)], lambda v, c: v.clone())[0]
        if got.shape != mine.shape or not torch.equal(got.to(mine.dtype), mine):
            mismatched.append(ts.hf_name)
    t = torch.tensor([float(len(mismatched))])
    dist.all_reduce(t)
    result[path] = {"checked": len(slices), "mismatched_total": int(t.item()), "examples": mismatched[:5]}
    engine.stop()
write_result(result)
dist.destroy_process_group()
