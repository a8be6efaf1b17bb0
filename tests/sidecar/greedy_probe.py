"""A probe for end-to-end sidecar runs (`run_recipes.py`'s "probe"): after each training step, the servers' greedy
generations against Hugging Face's on the trainer's full weights, and each server's sampled log-probs against HF's
(`workers/run_sidecar.greedy_check`: the check's generation pushes the step's weights first, through the checkpoint
engine and its verification). Rank 0 appends one JSON line per step to `<output_dir>/greedy.jsonl`, with the step's
`rollout/logprob_diff_max`. It checks after the step; it changes nothing the step does."""

import json
from pathlib import Path

import yaml

from hybrid_rl.config import load_config


def after_each_step(trainer) -> None:
    from tests.sidecar.workers.run_sidecar import greedy_check

    step_of = trainer.step
    own = Path(trainer.out) / f"probe_config.rank{trainer.dims.rank}.yaml"  # the run's own config, as resolved
    own.write_text(yaml.safe_dump({"defaults": ["base", "_self_"], **trainer.s.config}, sort_keys=False))
    cfg = load_config(str(own), [])

    def step(n: int) -> dict:
        metrics = step_of(n)
        check = greedy_check(trainer.c, cfg, trainer)
        if trainer.dims.is_main:
            check.update(step=n, logprob_diff_max=metrics["rollout/logprob_diff_max"],
                         grad_norm=metrics.get("actor/grad_norm", 0.0))
            with open(Path(trainer.out) / "greedy.jsonl", "a") as f:
                f.write(json.dumps(check) + "\n")
        return metrics

    trainer.step = step
