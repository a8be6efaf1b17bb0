"""vLLM's selected experts, captured per request inside its worker (`colocated.routes`), against transformers'
own routing of the same tokens (prompt + generated but the last); then, in bfloat16, the log-prob mismatch between
vLLM's rollout and transformers with and without replaying the captured routes. Writes a JSON verdict to
$HR_TEST_OUT."""

import json
import os
import sys
import tempfile

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from hybrid_rl.colocated import routes  # noqa: E402
from hybrid_rl.model.routing_replay import record_routes, replay_routes, routers  # noqa: E402

PROMPTS = [[58, 382, 266, 224, 20, 21], [30, 31, 32], [100, 200, 300, 40, 41], [7, 8, 9, 10]]
# The tiny model's routers are far from ties: in bfloat16 vLLM and transformers pick the same experts for every
# token (the mismatch is then the same with and without replay). Each router row is pulled to 1% of its distance
# from row 0, so the experts' logits nearly tie and bfloat16's rounding flips some choices, as at real size.
TIE = 0.01
result = {}
for path in sys.argv[1:]:
    # The prefix cache would serve a repeated prompt's tokens without computing them (no routes to capture).
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              kv_cache_memory_bytes=2**28, enable_prefix_caching=False)
    layers = llm.collective_rpc(routes.install)[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=12, temperature=1.0,
                                                                                  seed=3))
    got = llm.collective_rpc(routes.take)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    per = []
    for out, prompt in zip(outs, PROMPTS, strict=True):
        rid = next(k for k in got if k.split("-")[0] == out.request_id)  # the engine suffixes the request id
        tokens = torch.tensor([prompt + list(out.outputs[0].token_ids)[:-1]])
        captured = got[rid]
        with torch.no_grad(), record_routes(hf) as rec:
            hf(input_ids=tokens)
        with torch.no_grad(), replay_routes(hf, captured) as replay:
            hf(input_ids=tokens)
        own = rec.routes()
        same = captured.shape == own.shape and bool(
            (captured.long().sort(-1).values == own.long().sort(-1).values).all())
        per.append({"tokens": tokens.shape[1], "shape": list(captured.shape), "dtype": str(captured.dtype),
                    "equal": same, "replay_agreement": replay.agreement})
    result[path] = {"layers": layers, "requests": per}
    del llm


def bf16_mismatch(path: str, folder: str) -> dict:
    """Mean |vLLM log-prob - transformers log-prob| of the generated tokens in bfloat16, transformers routing on its
    own (`none`) and replaying vLLM's captured routes (`rollout`), with nearly tied routers (`TIE`)."""
    from transformers import AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for r in routers(hf):
            r.weight.copy_(r.weight[:1] + TIE * (r.weight - r.weight[:1]))
    hf.save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    llm = LLM(model=folder, dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
              kv_cache_memory_bytes=2**28, enable_prefix_caching=False)
    llm.collective_rpc(routes.install)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=24, temperature=1.0, seed=5, logprobs=0))
    got = llm.collective_rpc(routes.take)[0]
    del llm
    hf = hf.to(torch.bfloat16)
    diffs, agreement = {"none": [], "rollout": []}, []
    for out, prompt in zip(outs, PROMPTS, strict=True):
        rid = next(k for k in got if k.split("-")[0] == out.request_id)
        gen = list(out.outputs[0].token_ids)
        vllm_lp = torch.tensor([d[t].logprob for d, t in zip(out.outputs[0].logprobs, gen, strict=True)])
        tokens = torch.tensor([prompt + gen[:-1]])
        for mode, lps in diffs.items():
            with torch.no_grad():
                if mode == "rollout":
                    with replay_routes(hf, got[rid]) as replay:
                        logits = hf(input_ids=tokens).logits[0].float()
                    agreement.append(replay.agreement)
                else:
                    logits = hf(input_ids=tokens).logits[0].float()
            lp = logits.log_softmax(-1)[len(prompt) - 1:].gather(-1, torch.tensor(gen)[:, None])[:, 0]
            lps += (lp - vllm_lp).abs().tolist()
    return {"mismatch": {k: sum(v) / len(v) for k, v in diffs.items()}, "tokens": len(diffs["none"]),
            "agreement": sum(agreement) / len(agreement)}


with tempfile.TemporaryDirectory() as tied:
    result["bf16"] = bf16_mismatch(sys.argv[1], tied)
json.dump(result, open(os.environ["HR_TEST_OUT"], "w"))
