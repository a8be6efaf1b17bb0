"""Prefix-shared passes (`trainer.prefix_share`) against today's packing: the update's and the reference's time.

    python benchmarks/prefix_share.py [--quick] [--size 25M] [--groups 2] [--threads 1] [--repeats 3] [--smoke]

One process, the packed SDPA of a CPU install (`hybrid_rl/model/attention.py`). Two shapes:

* `p256_r32_n8`: groups of 8 samples sharing a 256-token prompt, responses of 32 tokens, the trainer's default
  micro-batch budget (8192 tokens);
* `demo`: the demo's shape (`hybrid_rl/demo/__main__.py`: rollout.n=8, rollout.max_new_tokens=8,
  trainer.micro_batch_tokens=512), its prompts tokenized from the demo task (`hybrid_rl.demo.task`), responses of
  4-8 tokens.

Per shape, four sides in turn, A B A B (`common.alternate`): the update (forward + backward of the policy log-prob
loss over all micro-batches, as `updates.update_actor` runs them; no optimizer step, the same on both sides) and the
reference pass (`experience.passes.logprobs_pass`, no grad), each unshared (today) and shared. Figures: medians of
seconds per pass; the ratio is unshared / shared (above 1: sharing is faster). The token counts say what the
shared layout saves: each group's prompt once instead of n times. Writes benchmarks/results/prefix_share.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

DEFAULT_BUDGET = 8192  # TrainerConfig.micro_batch_tokens
DEMO_BUDGET = 512  # the demo's trainer.micro_batch_tokens


def make_groups(prompts: list[list[int]], n: int, response_lens: tuple[int, int], vocab: int, seed: int = 0):
    import torch

    from hybrid_rl.types import Sample

    rng, out = random.Random(seed), []
    for g, prompt in enumerate(prompts):
        for _ in range(n):
            resp = [rng.randrange(4, vocab) for _ in range(rng.randint(*response_lens))]
            out.append(Sample(len(out), torch.tensor(prompt), torch.tensor(resp), torch.zeros(0), False, g, g, {}))
    return out


def update_pass(model, samples, budget: int, share: bool) -> int:
    from hybrid_rl.model.forward import micro_batches, policy_logprobs

    tokens = 0
    for mb in micro_batches(samples, budget, share=share):
        logp = policy_logprobs(model, mb, temperature=1.0)
        (-logp.sum() / logp.numel()).backward()
        tokens += mb.packed.num_tokens
    return tokens


def demo_prompts(tokenizer, count: int) -> list[list[int]]:
    train, _ = common.task_files()
    rows = [json.loads(line) for line in Path(train).read_text().splitlines()[:count]]
    return [tokenizer(r["prompt"]).input_ids for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 rounds, one p256 group (~3 min)")
    p.add_argument("--size", default="25M", choices=sorted(common.SIZES))
    p.add_argument("--groups", type=int, help="groups of the p256_r32_n8 shape (default 1 quick, 2 full; the demo: 8)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a rank's count)")
    p.add_argument("--repeats", type=int, help="alternating rounds (default 2 quick, 3 full)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    a = p.parse_args()
    a.groups = a.groups or (1 if a.quick else 2)
    shapes = {"p256_r32_n8": (256, (32, 32), 8, a.groups, DEFAULT_BUDGET), "demo": (None, (4, 8), 8, 8, DEMO_BUDGET)}
    if a.smoke:
        a.size, a.repeats = "4M", 1
        shapes = {"p256_r32_n8": (16, (4, 4), 2, 1, DEFAULT_BUDGET), "demo": (None, (4, 8), 2, 1, DEMO_BUDGET)}
    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    import torch
    from transformers import AutoModelForCausalLM

    from hybrid_rl.experience.passes import logprobs_pass
    from hybrid_rl.model.attention import register
    from hybrid_rl.model.loading import load_tokenizer

    torch.set_num_threads(a.threads)
    repeats = a.repeats or (2 if a.quick else 3)
    path = common.sized_model(a.size)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=register())
    model = model.to(a.device)
    model.config.use_cache = False
    vocab, tokenizer = model.config.vocab_size, load_tokenizer(str(path))
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    rows, runs_all = [], {}
    for name, (prompt_len, resp, n, groups, budget) in shapes.items():
        rng = random.Random(1)
        prompts = (demo_prompts(tokenizer, groups) if prompt_len is None
                   else [[rng.randrange(4, vocab) for _ in range(prompt_len)] for _ in range(groups)])
        samples = make_groups(prompts, n, resp, vocab)

        def timed(fn):
            def run():
                model.zero_grad(set_to_none=True)
                sync()
                t = time.perf_counter()
                fn()
                sync()
                return time.perf_counter() - t

            return run

        sides = {}
        for share in (False, True):
            tag = "shared" if share else "unshared"
            sides[f"update_{tag}"] = timed(lambda s=share, x=samples, b=budget: update_pass(model, x, b, s))
            sides[f"reference_{tag}"] = timed(lambda s=share, x=samples, b=budget: logprobs_pass(
                model, x, temperature=1.0, budget=b, share=s))
        tokens = {tag: update_pass(model, samples, budget, tag == "shared") for tag in ("unshared", "shared")}  # warm
        runs = common.alternate(sides, repeats)
        runs_all[name] = runs
        for pass_ in ("update", "reference"):
            base, new = common.median(runs[f"{pass_}_unshared"]), common.median(runs[f"{pass_}_shared"])
            rows.append({"shape": name, "pass": pass_, "unshared_s": base, "shared_s": new, "ratio": base / new,
                         "tokens": f"{tokens['unshared']} -> {tokens['shared']}",
                         "prompt": sum(len(q) for q in prompts) // len(prompts), "n": n, "groups": groups})
    print(f"\n{a.size} model, float32, {a.threads} thread(s), {a.device}; medians of {repeats} alternating rounds")
    print(common.table(rows, [("shape", "shape", "s"), ("pass", "pass", "s"), ("unshared_s", "today s", ".3f"),
                              ("shared_s", "shared s", ".3f"), ("ratio", "ratio", ".2f"), ("tokens", "tokens", "s")]))
    common.write_result("prefix_share", {"rows": rows, "samples": runs_all,
                                         "settings": {"size": a.size, "threads": a.threads, "repeats": repeats,
                                                      "device": a.device, "shapes": shapes}}, quick=a.quick)


if __name__ == "__main__":
    main()
