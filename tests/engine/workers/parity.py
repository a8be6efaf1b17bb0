"""Weights synced into vLLM reproduce the FSDP model: greedy text equals HF, sampled log-probs match.

Run under torchrun; writes a JSON verdict to $HR_TEST_OUT. Repeats over 3 optimizer steps so the
weights change between syncs.
"""

import argparse

import torch
import torch.distributed as dist
from common import build, full_state_dict, log, write_result
from transformers import AutoModelForCausalLM

from hybrid_rl.engine.vllm_engine import Sampling
from hybrid_rl.model.logprobs import forward_logprobs

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--release", default="keep", choices=["keep", "restart"])
p.add_argument("--chat", type=int, default=0, help="N chat-formatted arithmetic prompts (a real chat model)")
p.add_argument("--new-tokens", type=int, default=12)
a = p.parse_args()

engine, model, opt, dims = build(a.model, tp=a.tp, release=a.release)
# The last prompt fills more than one KV block (128 tokens on CPU): the prefix cache would serve its first
# block, computed with the previous step's weights, unless the sync resets it.
prompts = [[58, 382, 266, 224, 20, 21], [30, 31, 32], [100, 200, 300, 40, 41], [7, 8, 9, 10],
           [(37 * i) % 400 + 20 for i in range(140)]]
if a.chat:  # questions a chat model answers, through its own chat template (the way the data loader renders them)
    import random

    from transformers import AutoTokenizer

    from hybrid_rl.demo.arithmetic import make_row

    tok, rng = AutoTokenizer.from_pretrained(a.model), random.Random(0)
    eos = tok.eos_token_id  # vLLM stops at it (and returns it); transformers must stop there too
    prompts = [tok.apply_chat_template(make_row(rng)["prompt"], tokenize=True, add_generation_prompt=True,
                                       return_dict=False) for _ in range(a.chat)]
    prompts = [list(p["input_ids"] if isinstance(p, dict) else p) for p in prompts]
else:
    eos = None  # random weights: both sides run to the token limit
result = {"steps": []}
hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
for step in range(a.steps):
    with engine.rollout_mode():
        greedy = engine.generate(prompts, Sampling(max_tokens=a.new_tokens, temperature=0.0), seeds=[0] * len(prompts))
        sampled = engine.generate(prompts, Sampling(max_tokens=a.new_tokens, temperature=1.0, n=2),
                                  seeds=[1000 * dims.dp_rank + i for i in range(len(prompts))])
    # HF greedy from the same (gathered) weights.
    hf.load_state_dict(full_state_dict(model))
    hf_greedy = []
    for pr in prompts:
        g = hf.generate(torch.tensor([pr]), max_new_tokens=a.new_tokens, do_sample=False, eos_token_id=eos,
                       pad_token_id=0)
        hf_greedy.append(g[0, len(pr):].tolist())
    vllm_greedy = [list(g[0].token_ids) for g in greedy]
    # FSDP log-probs of vLLM's sampled tokens (every rank in lockstep: FSDP forwards are collective).
    max_diff = 0.0
    loss = 0.0
    for i, group in enumerate(sampled):
        for gen in group:
            ids = torch.tensor([prompts[i] + list(gen.token_ids)])
            pos = torch.arange(ids.shape[1])[None]
            tgt = torch.roll(ids, -1, dims=1)
            lp = forward_logprobs(model, ids, pos, tgt)[0, len(prompts[i]) - 1 : -1]
            max_diff = max(max_diff, (lp.detach() - torch.tensor(gen.logprobs)).abs().max().item())
            loss = loss - lp.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    log(f"step {step}: greedy equal={vllm_greedy == hf_greedy} max |dlogp|={max_diff:.2e} path={engine.report.sync_path}")
    d = torch.tensor([max_diff])
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    eq = torch.tensor([float(vllm_greedy == hf_greedy)])
    dist.all_reduce(eq, op=dist.ReduceOp.MIN)
    result["steps"].append({"greedy_equal": bool(eq.item()), "max_logprob_diff": d.item(),
                            "sync_path": engine.report.sync_path, "bytes": engine.report.bytes_received,
                            "vllm": vllm_greedy, "hf": hf_greedy,
                            "texts": [tok.decode(g, skip_special_tokens=True) for g in vllm_greedy] if a.chat else []})
write_result(result)
engine.close()
dist.destroy_process_group()
