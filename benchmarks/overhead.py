"""The data plane's cost: the time a step spends outside generation, model passes, update and sync.

    python benchmarks/overhead.py [--quick] [--nproc 2] [--shapes 64x256 256x512 512x1024 1024x2048]

Runs the real trainer (`build` -> `Trainer.step`, GRPO with a reference model and reward workers) under
torchrun, with generation replaced by a synthetic engine that returns responses of exactly the asked
shape (random tokens and log-probs, as vLLM's output objects: Python lists), and a tiny model so that
its passes are cheap. Everything the trainer timed as model work -- generation (the synthetic engine's
own time), old log-probs, reference, update, reward wait, sync and switch -- is subtracted from the
step; what remains is the data plane: turning outputs into samples, the index all-gather, scoring
hand-off (decoding), the token exchange to the training ranks, packing, advantages, metrics, host syncs.

Reported per shape (samples x response tokens): that remainder per step, and per million response
tokens per rank. Target: <= 1 s per million response tokens per rank, growing linearly (the largest
shape's per-token figure within 1.5x of the smallest's). The first step of each shape is a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SUBTRACTED = ("old_logp", "reference", "critic", "reward_model", "update", "reward_wait", "sync", "switch")
PROMPT_TOKENS = 64
SAMPLES_PER_PROMPT = 8


# =================================================================================================
# Worker (under torchrun)
# =================================================================================================


class SyntheticEngine:
    """Stands in for the hybrid engine: `generate` returns vLLM-shaped outputs of a fixed response length."""

    def __init__(self, response_tokens: int, vocab: int, seed: int):
        from hybrid_rl.colocated.hybrid import SwitchReport

        self.response_tokens, self.vocab, self.seed = response_tokens, vocab, seed
        self.report = SwitchReport()
        self.seconds = 0.0  # time spent making outputs: generation, subtracted from the step

    def rollout_mode(self):
        from contextlib import nullcontext

        return nullcontext(self)

    def generate(self, prompts, sampling, seeds):
        import torch

        from hybrid_rl.types import Generation

        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(self.seed + seeds[0] if seeds else self.seed)
        out = []
        for i in range(len(prompts)):
            ids = torch.randint(4, self.vocab, (sampling.n, self.response_tokens), generator=g).tolist()
            lps = (-torch.rand(sampling.n, self.response_tokens, generator=g) * 3).tolist()
            out.append([Generation(i, tuple(ids[j]), tuple(lps[j]), "length") for j in range(sampling.n)])
        self.seconds += time.perf_counter() - t0
        return out

    def close(self) -> None:
        pass


def worker(shapes: list[tuple[int, int]], model: str, steps: int) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from hybrid_rl.build import build
    from hybrid_rl.config import load_config
    from hybrid_rl.data import PromptLoader, PromptRecord, ReadOnlyFields
    from hybrid_rl.trainer import Trainer

    logging.basicConfig(level=logging.WARNING)
    train, _ = common.task_files()
    rows = []
    for samples, tokens in shapes:
        prompts = samples // SAMPLES_PER_PROMPT
        overrides = [f"model.path={model}", f"data.train_files=[{train}]", f"data.prompts_per_step={prompts}",
                     f"rollout.n={SAMPLES_PER_PROMPT}", f"rollout.max_new_tokens={tokens}",
                     f"trainer.total_steps={steps}", f"trainer.output_dir={common.CACHE / 'overhead' / str(samples)}",
                     "trainer.show_progress=false", "trainer.export=false", "trainer.resume=never",
                     "reward.fn=tests.e2e.rewards:length_parity", "reward.num_workers=1",
                     "trainer.micro_batch_tokens=65536", "model.dtype=float32", "data.max_prompt_tokens=128",
                     # The synthetic engine's log-probs are random: the policy-mismatch guard would (rightly) stop it.
                     "trainer.max_logprob_diff=null"]
        c = build(load_config("grpo", overrides))
        engine = SyntheticEngine(tokens, c.actor.module.config.vocab_size, seed=c.dims.rank)
        c.rollout.engine = engine  # the colocated worker (rollout.Sampler) generates with it
        g = torch.Generator().manual_seed(0)
        vocab = c.actor.module.config.vocab_size
        records = [PromptRecord(i, "", tuple(torch.randint(4, vocab, (PROMPT_TOKENS,), generator=g).tolist()),
                                ReadOnlyFields({})) for i in range(4 * prompts)]
        c.train_loader = PromptLoader(records, prompts, seed=0)
        trainer = Trainer(c)
        per_step = []
        try:
            for step in range(1, steps + 1):
                engine.seconds = 0.0
                if os.environ.get("HR_PROFILE") and step == steps and c.dims.rank == 0:
                    import cProfile

                    prof = cProfile.Profile()
                    m = prof.runcall(trainer.step, step)
                    prof.dump_stats(str(common.CACHE / f"overhead_{samples}x{tokens}.prof"))
                else:
                    m = trainer.step(step)
                subtracted = engine.seconds + sum(m.get(f"timing/{k}_s", 0.0) for k in SUBTRACTED)
                per_step.append({"step_s": m["timing/step_s"], "generation_s": engine.seconds,
                                 "passes_update_sync_s": subtracted - engine.seconds,
                                 "overhead_s": m["timing/step_s"] - subtracted})
        finally:
            trainer.close()
        rows.append({"samples": samples, "response_tokens": tokens, "steps": per_step[1:]})
        dist.barrier()
    if dist.get_rank() == 0:
        common.worker_write({"rows": rows})
    dist.destroy_process_group()


# =================================================================================================
# Driver
# =================================================================================================


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two small shapes, 3 steps")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--shapes", nargs="+", default=["64x256", "256x512", "512x1024", "1024x2048"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    a = p.parse_args()
    if a.smoke:
        a.shapes, a.steps, a.quick = ["32x16"], 2, False
    shapes = [tuple(int(x) for x in s.split("x")) for s in (["64x256", "256x512"] if a.quick else a.shapes)]
    if a.worker:
        worker(shapes, a.model, a.steps)
        return
    model = common.tiny_model(64, 2, 4, 2, 128)
    common.task_files()
    result = common.torchrun(__file__, ["--worker", "--model", str(model), "--steps", str(a.steps), "--shapes",
                                        *[f"{s}x{t}" for s, t in shapes]], nproc=a.nproc, timeout=3600,
                             tag="overhead")
    report(result["rows"], a)


def report(rows: list[dict], a) -> None:
    table = []
    for r in rows:
        med = {k: common.median([s[k] for s in r["steps"]]) for k in r["steps"][0]}
        tokens_per_rank = r["samples"] * r["response_tokens"] / a.nproc
        table.append({"shape": f"{r['samples']}x{r['response_tokens']}", **med,
                      "overhead_per_mtok_rank_s": med["overhead_s"] / tokens_per_rank * 1e6,
                      "response_tokens_per_rank": tokens_per_rank})
    print(common.table(table, [("shape", "samples x tokens", "s"), ("step_s", "step s", ".2f"),
                               ("generation_s", "synthetic gen s", ".2f"),
                               ("passes_update_sync_s", "passes+update s", ".2f"), ("overhead_s", "overhead s", ".3f"),
                               ("overhead_per_mtok_rank_s", "s per M tokens/rank", ".3f")]))
    per_tok = [t["overhead_per_mtok_rank_s"] for t in table]
    targets = [common.check("overhead per million response tokens per rank (largest shape)", per_tok[-1], 1.0,
                            higher_is_better=False, unit=" s")]
    if len(per_tok) > 1:
        targets.append(common.check("growth: per-token overhead, largest / smallest shape", per_tok[-1] / per_tok[0],
                                    1.5, higher_is_better=False))
    common.write_result("overhead", {"rows": table, "nproc": a.nproc, "targets": targets,
                                     "headline": [{"what": "overhead s per M response tokens per rank",
                                                   "value": per_tok[-1]}]}, quick=a.quick)
    print(json.dumps(per_tok))


if __name__ == "__main__":
    main()
