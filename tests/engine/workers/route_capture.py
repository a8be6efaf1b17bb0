"""vLLM's selected experts, captured per request inside its worker (`colocated.routes`), against transformers'
own routing of the same tokens (prompt + generated but the last). Writes a JSON verdict to $HR_TEST_OUT."""

import json
import os
import sys

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from hybrid_rl.colocated import routes  # noqa: E402
from hybrid_rl.model.routing_replay import record_routes, replay_routes  # noqa: E402

PROMPTS = [[58, 382, 266, 224, 20, 21], [30, 31, 32], [100, 200, 300, 40, 41], [7, 8, 9, 10]]
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
json.dump(result, open(os.environ["HR_TEST_OUT"], "w"))
