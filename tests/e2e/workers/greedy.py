"""Greedy continuations of fixed prompts from a model folder, with vLLM or transformers (JSON on stdout).

    python greedy.py vllm|hf|peft MODEL_DIR [ADAPTER_DIR]
"""

import json
import sys

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

PROMPTS = [[58, 382, 266, 224, 20, 21], [30, 31, 32], [100, 200, 300, 40, 41]]
NEW = 10


def main() -> None:
    kind, path = sys.argv[1], sys.argv[2]
    if kind == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=2**28,
                  enable_chunked_prefill=False, seed=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
        print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
        return
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if kind == "peft":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, sys.argv[3])
    out = []
    for p in PROMPTS:
        g = model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
