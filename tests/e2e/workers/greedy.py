"""Greedy continuations of fixed prompts from model folders, with vLLM or transformers (JSON on stdout).

    python greedy.py '[["vllm"|"hf", MODEL_DIR] | ["peft", MODEL_DIR, ADAPTER_DIR], ...]'

Every job in one process (one interpreter start and one set of imports for all); the last line of stdout is the
list of each job's continuations, in order. Each vLLM job is its own `vllm.LLM`, shut down before the next job.
"""

import gc
import json
import sys

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

PROMPTS = [[58, 382, 266, 224, 20, 21], [30, 31, 32], [100, 200, 300, 40, 41]]
NEW = 10


def vllm_greedy(path: str) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=2**28,
              enable_chunked_prefill=False, seed=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()  # its engine process ends here, not at some later collection
        del llm
        gc.collect()


def hf_greedy(path: str, adapter: str | None = None) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    out = []
    for p in PROMPTS:
        g = model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def main() -> None:
    results = []
    for kind, *paths in json.loads(sys.argv[1]):
        results.append(vllm_greedy(*paths) if kind == "vllm" else hf_greedy(*paths))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
