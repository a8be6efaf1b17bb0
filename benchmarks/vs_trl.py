"""The same GRPO workload through hybrid_rl and through TRL's GRPOTrainer: median step time and tokens/s.

    python benchmarks/vs_trl.py [--quick] [--sizes 4M 25M] [--precisions bf16 fp32] [--rounds 3] [--steps 5]

Workload (both sides): the tiny model folder, the demo task's prompts (plain text, no chat
template), the math answer matcher (`hybrid_rl.rewards.math.score`, which TRL calls through a reward
function), 4 prompts x 8 samples per step, up to 64 new tokens at temperature 1, KL to a reference
model (coefficient 0.001: our `algorithm.kl_coef`, TRL's `beta`), AdamW at lr 1e-6 with a constant
schedule, one optimizer step per generation batch, grad clip 1.0, std-normalised group advantages,
token-mean loss (TRL `loss_type="dapo"`).

* hybrid_rl: 2 ranks under torchrun, 1 thread each (data parallel over the cores: the design),
  vLLM rollout. Precision bf16 = FSDP bf16 compute + bf16 rollout; fp32 = both float32.
* TRL: its natural single-process setup -- one process, torch's default thread count (all
  cores), generation with `transformers` generate (TRL's vLLM modes need a vLLM in TRL's
  environment and a server or colocation set-up; not used). Precision bf16 = `bf16=True` (autocast
  mixed precision), fp32 = `bf16=False`. Its best settings for this CPU: no gradient checkpointing
  (TRL's default is on; the models are tiny), fused AdamW (its default).

TRL runs in its own virtual environment, `benchmarks/.trl-venv`, created here on first use
(`python3 -m venv` + pip; pinned versions below; torchvision/torchaudio/torchcodec removed, as they
break imports beside the CPU torch). Rounds alternate the sides: ours (every config) then TRL's
(every config), `--rounds` times; each run's first step is a warm-up; the figures are medians over
all measured steps of all rounds. Writes benchmarks/results/vs_trl.json.
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

TRL_VENV = common.HERE / ".trl-venv"
TRL_PINS = ["torch==2.13.0", "trl==1.16.0", "transformers==5.23.0", "accelerate==1.15.0", "datasets==5.2.0"]
BREAKS_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]
WORKLOAD = {"prompts": 4, "n": 8, "max_new_tokens": 64, "lr": 1e-6, "kl": 0.001}


# =================================================================================================
# TRL side (runs inside benchmarks/.trl-venv)
# =================================================================================================


def trl_worker(spec: dict) -> None:
    """Run each config for `steps` GRPO steps with TRL; print one JSON line with per-step times and tokens."""
    sys.path.insert(0, str(common.REPO))  # the math matcher: pure Python, no torch
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybrid_rl.rewards.math import score

    rows = [json.loads(line) for line in Path(spec["train"]).read_text().splitlines()]
    dataset = Dataset.from_list(rows)

    def math_reward(completions, ground_truth, **_):
        return [score(c, g) for c, g in zip(completions, ground_truth, strict=True)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.t0 = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self.t0)

    out = []
    for cfg in spec["configs"]:
        timer = StepTimer()
        w = WORKLOAD
        args = GRPOConfig(
            output_dir=str(common.CACHE / "trl_out"), per_device_train_batch_size=w["prompts"] * w["n"],
            num_generations=w["n"], max_completion_length=w["max_new_tokens"], temperature=1.0, beta=w["kl"],
            learning_rate=w["lr"], lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
            loss_type="dapo", scale_rewards="group", max_steps=spec["steps"], logging_steps=1, save_strategy="no",
            bf16=cfg["precision"] == "bf16", use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False,
            report_to="none", disable_tqdm=True, seed=0,
        )
        trainer = GRPOTrainer(model=cfg["model"], reward_funcs=math_reward, args=args, train_dataset=dataset,
                              callbacks=[timer])
        trainer.train()
        cumulative = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
        tokens = [b - a for a, b in zip([0.0, *cumulative[:-1]], cumulative, strict=True)]
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
        out.append(dict(cfg, step_s=timer.seconds, tokens=tokens, mean_length=lengths,
                        threads=torch.get_num_threads(), dtype=str(next(trainer.model.parameters()).dtype)))
        del trainer
    print("TRL_RESULT " + json.dumps(out), flush=True)


def ensure_trl_venv(create: bool = True) -> tuple[Path | None, str]:
    """The TRL environment's python, creating the venv on first use; (None, why) when it cannot be had."""
    python = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / ".installed"
    if python.exists() and stamp.exists() and stamp.read_text() == " ".join(TRL_PINS):
        return python, "existing"
    if not create:
        return None, f"{TRL_VENV.relative_to(common.REPO)} does not exist (not created here)"
    steps = [
        [shutil.which("python3") or sys.executable, "-m", "venv", str(TRL_VENV)],
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *TRL_PINS],
        [str(python), "-m", "pip", "uninstall", "-q", "-y", *BREAKS_CPU_TORCH],
    ]
    print(f"creating {TRL_VENV.relative_to(common.REPO)} ({' '.join(TRL_PINS)}) ...", flush=True)
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 and "uninstall" not in cmd:
            return None, f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
    check = subprocess.run([str(python), "-c", "import trl, transformers, torch; print(trl.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        return None, f"TRL installed but does not import: {check.stderr.strip()[-800:]}"
    stamp.write_text(" ".join(TRL_PINS))
    return python, "created"


def run_trl(python: Path, configs: list[dict], steps: int, threads: int) -> list[dict]:
    train, _ = common.task_files()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VIRTUAL_ENV")}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    spec = json.dumps({"configs": configs, "steps": steps, "train": train})
    proc = subprocess.run([str(python), __file__, "--trl-worker", spec], capture_output=True, text=True, env=env,
                          cwd=common.REPO, timeout=3600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TRL_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print("\n".join((proc.stdout + proc.stderr).splitlines()[-40:]), file=sys.stderr)
        raise RuntimeError(f"the TRL run failed (exit {proc.returncode})")
    return json.loads(line.removeprefix("TRL_RESULT "))


# =================================================================================================
# Our side, the comparison, the report
# =================================================================================================


def run_ours(configs: list[dict], steps: int, round_index: int) -> list[dict]:
    import throughput

    w = WORKLOAD
    runs = []
    for c in configs:
        dtype = "bfloat16" if c["precision"] == "bf16" else "float32"
        out = common.CACHE / "runs" / f"vs_trl_{c['size']}_{c['precision']}"
        throughput._clean(out)
        extra = [f"model.dtype={dtype}", f"rollout.dtype={dtype}", f"optim.lr={w['lr']}",
                 f"algorithm.kl_coef={w['kl']}", "algorithm.use_reference=true", "optim.schedule=constant",
                 "optim.weight_decay=0.0", "optim.grad_clip=1.0", "rollout.temperature=1.0"]
        overrides = throughput.run_overrides(c["model"], out, prompts=w["prompts"], n=w["n"],
                                             max_new_tokens=w["max_new_tokens"], steps=steps, extra=extra)
        runs.append({"name": f"{c['size']}_{c['precision']}", "recipe": "grpo", "overrides": overrides})
    summaries = throughput.launch(runs, nproc=2, tag=f"vs_trl_{round_index}")
    out = []
    for c, s in zip(configs, summaries, strict=True):
        out.append(dict(c, step_s=s["step_samples_s"], tokens=s["step_tokens_samples"], phases=s["phases_s"]))
    return out


def compare(ours: dict[str, list], trl: dict[str, list], configs: list[dict]) -> list[dict]:
    rows = []
    for c in configs:
        key = f"{c['size']}_{c['precision']}"
        o_steps = [x for r in ours[key] for x in r["step_s"]]
        t_steps = [x for r in trl[key] for x in r["step_s"][1:]]  # TRL's first step is the warm-up
        o_tok = [t / s for r in ours[key] for t, s in zip(r["tokens"], r["step_s"], strict=True)]
        t_tok = [t / s for r in trl[key] for t, s in zip(r["tokens"][1:], r["step_s"][1:], strict=True)]
        row = {"size": c["size"], "precision": c["precision"], "ours_step_s": common.median(o_steps),
               "trl_step_s": common.median(t_steps), "ours_tok_s": common.median(o_tok),
               "trl_tok_s": common.median(t_tok), "ours_steps": o_steps, "trl_steps": t_steps,
               "ours_phases_s": ours[key][-1]["phases"], "trl_threads": trl[key][-1]["threads"],
               "trl_param_dtype": trl[key][-1]["dtype"]}
        row["step_ratio"] = row["trl_step_s"] / row["ours_step_s"]  # > 1: ours is faster
        row["tok_ratio"] = row["ours_tok_s"] / row["trl_tok_s"]
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4M model, fp32 only, 1 round of 3 steps (~4 min)")
    p.add_argument("--sizes", nargs="+", choices=sorted(common.SIZES), help="default 4M quick, 4M 25M full")
    p.add_argument("--precisions", nargs="+", choices=["bf16", "fp32"], help="default fp32 quick, bf16 fp32 full")
    p.add_argument("--trl-threads", type=int, default=0, help="TRL's torch threads (0 = torch's default: all cores)")
    p.add_argument("--rounds", type=int, help="alternating rounds (default 1 quick, 3 full)")
    p.add_argument("--steps", type=int, help="steps per run incl. one warm-up (default 3 quick, 5 full)")
    p.add_argument("--smoke", action="store_true",
                   help=common.SMOKE_HELP + "; TRL's side runs only where benchmarks/.trl-venv exists (it is not "
                   "created in smoke mode: a multi-GB install)")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_worker:
        trl_worker(json.loads(a.trl_worker))
        return
    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    rounds, steps = a.rounds or (1 if a.quick else 3), a.steps or (3 if a.quick else 5)
    a.sizes = a.sizes or (["4M"] if a.quick else ["4M", "25M"])
    a.precisions = a.precisions or (["fp32"] if a.quick else ["bf16", "fp32"])
    configs = [{"size": s, "precision": pr, "model": str(common.sized_model(s))} for s in a.sizes
               for pr in a.precisions]
    if a.smoke:
        rounds, steps, a.trl_threads = 1, 2, a.trl_threads
        configs = [dict(configs[0], size="4M", precision="bf16", model=str(common.sized_model("4M")))]
        WORKLOAD.update(prompts=2, n=2, max_new_tokens=4)
    python, how = ensure_trl_venv(create=not a.smoke)
    if python is None and a.smoke:
        rows = run_ours(configs, steps, 0)
        print(f"smoke: our side ran ({rows[0]['step_s']} s/step); TRL side not run: {how}")
        common.write_result("vs_trl", {"trl_error": how, "ours": rows}, quick=a.quick)
        return
    if python is None:
        print(f"TRL side NOT RUN: {how}")
        common.write_result("vs_trl", {"trl_error": how, "tried": TRL_PINS}, quick=a.quick)
        return
    print(f"TRL environment: {how} ({TRL_VENV.relative_to(common.REPO)}: {' '.join(TRL_PINS)})")
    ours: dict[str, list] = {f"{c['size']}_{c['precision']}": [] for c in configs}
    trl: dict[str, list] = {k: [] for k in ours}
    for r in range(rounds):
        for row in run_ours(configs, steps, r):
            ours[f"{row['size']}_{row['precision']}"].append(row)
        for row in run_trl(python, configs, steps, a.trl_threads):
            trl[f"{row['size']}_{row['precision']}"].append(row)
        print(f"round {r + 1}/{rounds} done", flush=True)
    rows = compare(ours, trl, configs)
    report(rows, rounds, steps, a.quick)


def report(rows: list[dict], rounds: int, steps: int, quick: bool) -> None:
    w = WORKLOAD
    print(f"\nGRPO, {w['prompts']} prompts x {w['n']} samples, <= {w['max_new_tokens']} new tokens, KL {w['kl']} with a "
          f"reference, AdamW lr {w['lr']}; {rounds} round(s) x {steps} steps (first of each run = warm-up)")
    print("hybrid_rl: 2 ranks x 1 thread (torchrun, vLLM rollout, FSDP2);  TRL: 1 process x "
          f"{rows[0]['trl_threads']} threads (its natural single-process set-up, transformers generate)")
    print(common.table(rows, [("size", "model", "s"), ("precision", "precision", "s"),
                              ("ours_step_s", "ours s/step", ".2f"), ("trl_step_s", "TRL s/step", ".2f"),
                              ("step_ratio", "TRL/ours time", ".2f"), ("ours_tok_s", "ours tok/s", ".0f"),
                              ("trl_tok_s", "TRL tok/s", ".0f"), ("tok_ratio", "ours/TRL tok/s", ".2f")]))
    for r in rows:
        ph = r["ours_phases_s"]
        big = sorted(ph, key=ph.get, reverse=True)[:3]
        faster = "ours faster" if r["step_ratio"] > 1 else "TRL faster"
        print(f"  {r['size']} {r['precision']}: {faster} ({r['step_ratio']:.2f}x step time); our step's largest "
              f"phases: " + ", ".join(f"{k} {ph[k]:.2f}s" for k in big))
    headline = [{"what": f"TRL/ours step time {r['size']} {r['precision']}", "value": r["step_ratio"]} for r in rows]
    # The target: a GRPO step at least 2x faster than TRL's at bf16 on the ~25M model.
    targets = [common.check(f"TRL/ours step time {r['size']} bf16", r["step_ratio"], 2.0, higher_is_better=True)
               for r in rows if r["size"] == "25M" and r["precision"] == "bf16"]
    common.write_result("vs_trl", {"rows": rows, "headline": headline, "targets": targets, "workload": w, "rounds": rounds, "steps": steps, "trl_pins": TRL_PINS,
                                   "setups": {"ours": "2 ranks x 1 thread, torchrun, vLLM rollout, FSDP2",
                                              "trl": "1 process, torch default threads, transformers generate"}},
                        quick=quick)


if __name__ == "__main__":
    main()
