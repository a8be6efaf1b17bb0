"""Weights synced into vLLM reproduce the FSDP model: greedy text equals HF, sampled log-probs match.

Run under torchrun; writes a JSON verdict to $HR_TEST_OUT, per model. Repeats over `--steps` optimizer
steps so the weights change between syncs. Several models run one after another in one launch (each with
its own vLLM engine): the architectures users train, tied and untied. In the same launch (one torchrun
start for all), `--packed MODEL` then checks the packed bf16 sync of MODEL (`packed_sync.py`), `--layout MODEL
...` our TP slices against vLLM's own sharding of each model (`layout_vs_vllm.py`), and `--broken-head MODEL`
syncs MODEL once more with the tied head's refresh switched off, and records the verification's error.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from common import build, full_state_dict, log, train_on_samples, write_result
from layout_vs_vllm import check_layout
from packed_sync import packed_check
from transformers import AutoModelForCausalLM

from hybrid_rl.distributed.mesh import init_distributed
from hybrid_rl.types import Sampling
from hybrid_rl.weightsync import vllm_landing
from hybrid_rl.weightsync.reshard import WeightSyncError

p = argparse.ArgumentParser()
p.add_argument("--models", nargs="*", default=[], help="models whose greedy parity to check")
p.add_argument("--tp", type=int, default=1)
p.add_argument("--steps", type=int, nargs="+", default=[3], help="optimizer steps per model (the last repeats)")
p.add_argument("--release", default="keep", choices=["keep", "restart"])
p.add_argument("--broken-head", default=None)
p.add_argument("--layout", nargs="*", default=[], help="models whose TP slices to check against vLLM's own sharding")
p.add_argument("--packed", default=None, help="a model whose packed bf16 sync to check (AVX512-BF16 machines)")
p.add_argument("--chat", type=int, default=0, help="N chat-formatted arithmetic prompts (a real chat model)")
p.add_argument("--new-tokens", type=int, default=12)
a = p.parse_args()
# The last prompt fills more than one KV block (128 tokens on CPU): the prefix cache would serve its first
# block, computed with the previous step's weights, unless the sync resets it.
prompts = [[58, 382, 266, 224, 20, 21], [30, 31, 32], [100, 200, 300, 40, 41], [7, 8, 9, 10],
           [(37 * i) % 400 + 20 for i in range(140)]]


def chat_prompts(model_path: str):
    """Questions a chat model answers, through its own chat template (the way the data loader renders them)."""
    import random

    from transformers import AutoTokenizer

    from hybrid_rl.demo.arithmetic import make_row

    tok, rng = AutoTokenizer.from_pretrained(model_path), random.Random(0)
    ids = [tok.apply_chat_template(make_row(rng)["prompt"], tokenize=True, add_generation_prompt=True,
                                   return_dict=False) for _ in range(a.chat)]
    return tok, [list(p["input_ids"] if isinstance(p, dict) else p) for p in ids]


def run(model_path: str, steps: int) -> dict:
    engine, model, opt, dims = build(model_path, tp=a.tp, release=a.release)
    # A chat model stops at its EOS (vLLM returns it, transformers must stop there too); random weights run to the limit.
    tok, prompts_ = chat_prompts(model_path) if a.chat else (None, prompts)
    eos = tok.eos_token_id if tok is not None else None
    result = {"steps": []}
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for step in range(steps):
        with engine.rollout_mode():
            greedy = engine.generate(prompts_, Sampling(max_tokens=a.new_tokens, temperature=0.0), seeds=[0] * len(prompts_))
            sampled = engine.generate(prompts_, Sampling(max_tokens=a.new_tokens, temperature=1.0, n=2),
                                      seeds=[1000 * dims.dp_rank + i for i in range(len(prompts_))])
        # HF greedy from the same (gathered) weights.
        hf.load_state_dict(full_state_dict(model))
        hf_greedy = []
        for pr in prompts_:
            g = hf.generate(torch.tensor([pr]), max_new_tokens=a.new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
            hf_greedy.append(g[0, len(pr):].tolist())
        vllm_greedy = [list(g[0].token_ids) for g in greedy]
        # FSDP log-probs of vLLM's sampled tokens, then a step on them.
        max_diff = train_on_samples(model, opt, prompts_, sampled)
        log(f"{Path(model_path).name} step {step}: greedy equal={vllm_greedy == hf_greedy} "
            f"max |dlogp|={max_diff:.2e} path={engine.report.sync_path}")
        d = torch.tensor([max_diff])
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        eq = torch.tensor([float(vllm_greedy == hf_greedy)])
        dist.all_reduce(eq, op=dist.ReduceOp.MIN)
        result["steps"].append({"greedy_equal": bool(eq.item()), "max_logprob_diff": d.item(),
                                "sync_path": engine.report.sync_path, "bytes": engine.report.bytes_received,
                                "vllm": vllm_greedy, "hf": hf_greedy,
                                "texts": [tok.decode(g, skip_special_tokens=True) for g in vllm_greedy] if tok else []})
    engine.close()
    return result


def broken_head(model_path: str) -> dict:
    """One sync with the tied head's refresh switched off: verification must stop it, naming the head."""
    vllm_landing.refresh_tied = lambda model, ties: None  # where every landing (both deployments) calls it
    engine, _, _, _ = build(model_path, tp=a.tp, release=a.release)
    try:
        with engine.rollout_mode():
            pass
        return {"raised": False, "message": ""}
    except WeightSyncError as e:
        return {"raised": True, "message": str(e), "mode_after_error": engine.mode.value}
    finally:
        engine.close()


results = {m: run(m, a.steps[min(i, len(a.steps) - 1)]) for i, m in enumerate(a.models)}
if a.packed:
    results["packed"] = packed_check(a.packed, a.tp)
if a.layout:  # before the broken head, which switches the tied head's refresh off for the rest of the process
    tp_rank = init_distributed(a.tp).tp_rank  # the process group is up: this reads the rank's place
    results["layout"] = {m: check_layout(m, a.tp, tp_rank) for m in a.layout}
if a.broken_head:
    results["broken_head"] = broken_head(a.broken_head)
write_result(results)
dist.destroy_process_group()
