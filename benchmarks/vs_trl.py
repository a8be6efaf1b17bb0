"""The same GRPO workload through hybrid_rl and through TRL's GRPOTrainer: median step time and tokens/s.

    python benchmarks/vs_trl.py [--quick] [--sizes 4M 25M 0.5B] [--precisions bf16 fp32] [--rounds 3] [--steps 5]
                                [--ours 2x1 1x2]

Workload (both sides): the tiny model folder, the demo task's prompts (plain text, no chat
template), the math answer matcher (`hybrid_rl.rewards.math.score`, which TRL calls through a reward
function), 4 prompts x 8 samples per step, up to 64 new tokens at temperature 1, KL to a reference
model (coefficient 0.001: our `algorithm.kl_coef`, TRL's `beta`), AdamW at lr 1e-6 with a constant
schedule, one optimizer step per generation batch, grad clip 1.0, std-normalised group advantages,
token-mean loss (TRL `loss_type="dapo"`). The 0.5B shape (Qwen2.5-0.5B's config, random bf16 weights,
`qwen_shapes.py`) runs the issue's workload instead: 4 prompts x 4 samples, 32 new tokens, KL 0.04, lr 1e-5.

Per phase, both sides: ours from the trainer's `timing/*` metrics (generate, sync + switch, reference,
update, other); TRL's from timers wrapped around its GRPOTrainer's own methods (`_generate`: generation;
`_get_per_token_logps_and_entropies` while a batch is prepared: the reference and old-log-prob passes;
`_calculate_rewards`; the rest of the step: the update -- forward, backward, clip, AdamW).
Floor (ours): the step's FLOPs at the measured matmul rate (throughput.py) plus the bytes a step must move at
the measured memory bandwidth (a large copy_, all cores): the rollout weights once per decoded token, the
weights three times for the passes (reference forward, update forward and backward) and AdamW's
read-modify-write of parameters, gradients and both moments (28 bytes per parameter).

* hybrid_rl: 2 ranks under torchrun, 1 thread each (`--ours 2x1`, the recipe's default), or one rank
  using both cores (`--ours 1x2`), vLLM rollout. Precision bf16 = FSDP bf16 compute + bf16 rollout; fp32 = both float32.
* TRL: its natural single-process setup -- one process, torch's default thread count (all
  cores), generation with `transformers` generate (TRL's vLLM modes need a vLLM in TRL's
  environment and a server or colocation set-up; not used). Precision bf16 = `bf16=True` (autocast
  mixed precision), fp32 = `bf16=False`. Its best settings for this CPU: no gradient checkpointing
  (TRL's default is on; the models are tiny), fused AdamW (its default). Its environment is the one this
  script was started in, without our runtime defaults: before 2026-11-28 it inherited them, our huge-page
  setting (`THP_MEM_ALLOC_ENABLE`, from that day) included; `--trl-huge-pages` gives it that one on purpose.

TRL runs in its own virtual environment, `benchmarks/.trl-venv`, created here on first use
(`python3 -m venv` + pip; pinned versions below; torchvision/torchaudio/torchcodec removed, as they
break imports beside the CPU torch). Rounds alternate the sides: ours (every config) then TRL's
(every config), `--rounds` times; each run's first step is a warm-up; the figures are medians over
all measured steps of all rounds. Writes benchmarks/results/vs_trl.json (`--name` for another name).
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
WORKLOAD_0_5B = {"prompts": 4, "n": 4, "max_new_tokens": 32, "lr": 1e-5, "kl": 0.04}  # issue 22's workload
SIZES = [*sorted(common.SIZES), "0.5B"]
ADAMW_BYTES_PER_PARAM = 28  # fp32 param r/w 8, grad r 4, two moments r/w 16


def workload(size: str) -> dict:
    return dict(WORKLOAD_0_5B if size == "0.5B" else WORKLOAD)


def model_for(size: str) -> str:
    import qwen_shapes

    return str(qwen_shapes.folder("0.5B") if size == "0.5B" else common.sized_model(size))


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
            self.seconds, self.t0, self.phases, self.acc = [], 0.0, [], {}

        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.acc = time.perf_counter(), {"generate": 0.0, "logp_passes": 0.0, "rewards": 0.0,
                                                      "prepare": 0.0}

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self.t0)
            a = self.acc
            self.phases.append({"generate": a["generate"], "reference": a["logp_passes"], "rewards": a["rewards"],
                                "update": self.seconds[-1] - a["prepare"],
                                "other": a["prepare"] - a["generate"] - a["logp_passes"] - a["rewards"]})

    def timed(timer, fn, key, only_while=None):
        def wrapper(*args, **kwargs):
            if only_while is not None and not only_while():
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.acc[key] = timer.acc.get(key, 0.0) + time.perf_counter() - t0
        return wrapper

    def instrument(trainer, timer) -> None:
        """TRL's own phases, timed around its methods (instance attributes shadow the class's)."""
        preparing = {"on": False}
        prepare = timed(timer, trainer._generate_and_score_completions, "prepare")

        def prepare_timed(*args, **kwargs):
            preparing["on"] = True
            try:
                return prepare(*args, **kwargs)
            finally:
                preparing["on"] = False

        trainer._generate_and_score_completions = prepare_timed
        trainer._generate = timed(timer, trainer._generate, "generate")
        trainer._calculate_rewards = timed(timer, trainer._calculate_rewards, "rewards")
        trainer._get_per_token_logps_and_entropies = timed(timer, trainer._get_per_token_logps_and_entropies,
                                                           "logp_passes", only_while=lambda: preparing["on"])

    out = []
    for cfg in spec["configs"]:
        timer = StepTimer()
        w = cfg["workload"]
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
        instrument(trainer, timer)
        trainer.train()
        cumulative = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
        tokens = [b - a for a, b in zip([0.0, *cumulative[:-1]], cumulative, strict=True)]
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
        out.append(dict(cfg, step_s=timer.seconds, phases=timer.phases, tokens=tokens, mean_length=lengths,
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


def run_trl(python: Path, configs: list[dict], steps: int, threads: int, huge_pages: bool) -> list[dict]:
    train, _ = common.task_files()
    env = common.peer_env(huge_pages=huge_pages)
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


def run_ours(configs: list[dict], steps: int, round_index: int, topology: str, shard_size: int = 0) -> list[dict]:
    import throughput

    layout, *levers = topology.split("+")  # e.g. 2x1+share: 2 ranks x 1 thread, trainer.prefix_share on
    nproc, threads = (int(x) for x in layout.split("x"))
    runs = []
    for c in configs:
        w = c["workload"]
        dtype = "bfloat16" if c["precision"] == "bf16" else "float32"
        out = common.CACHE / "runs" / f"vs_trl_{c['size']}_{c['precision']}"
        throughput._clean(out)
        extra = [f"model.dtype={dtype}", f"rollout.dtype={dtype}", f"optim.lr={w['lr']}",
                 f"algorithm.kl_coef={w['kl']}", "algorithm.use_reference=true", "optim.schedule=constant",
                 "optim.weight_decay=0.0", "optim.grad_clip=1.0", "rollout.temperature=1.0",
                 f"trainer.shard_size={shard_size}", f"trainer.prefix_share={'share' in levers}"]
        overrides = throughput.run_overrides(c["model"], out, prompts=w["prompts"], n=w["n"],
                                             max_new_tokens=w["max_new_tokens"], steps=steps, extra=extra)
        runs.append({"name": f"{c['size']}_{c['precision']}", "recipe": "grpo", "overrides": overrides})
    summaries = throughput.launch(runs, nproc=nproc, threads=threads,
                                  tag=f"vs_trl_{topology.replace('+', '_')}_{round_index}")
    out = []
    for c, s in zip(configs, summaries, strict=True):
        out.append(dict(c, topology=topology, step_s=s["step_samples_s"], tokens=s["step_tokens_samples"],
                        phases=s["phases_s"], floor_compute_s=s["floor_s"], params=s["params"],
                        generated_tokens=s["generated_tokens"]))
    return out


def floor_s(run: dict, bandwidth: float) -> tuple[float, float]:
    """(compute floor, bytes floor) of one of our steps (see the module doc)."""
    w, p = run["workload"], run["params"]
    wbytes = 2 if run["precision"] == "bf16" else 4
    moved = p * wbytes * (w["max_new_tokens"] + 3) + p * ADAMW_BYTES_PER_PARAM
    return run["floor_compute_s"], moved / bandwidth


def compare(ours: dict[str, list], trl: dict[str, list], configs: list[dict], topologies: list[str],
            bandwidth: float) -> list[dict]:
    rows = []
    for c, topo in ((c, t) for c in configs for t in topologies):
        key = f"{c['size']}_{c['precision']}"
        mine = [r for r in ours[key] if r["topology"] == topo]
        o_steps = [x for r in mine for x in r["step_s"]]
        t_steps = [x for r in trl[key] for x in r["step_s"][1:]]  # TRL's first step is the warm-up
        o_tok = [t / s for r in mine for t, s in zip(r["tokens"], r["step_s"], strict=True)]
        t_tok = [t / s for r in trl[key] for t, s in zip(r["tokens"][1:], r["step_s"][1:], strict=True)]
        t_phases = [ph for r in trl[key] for ph in r["phases"][1:]]
        compute, moved = floor_s(mine[-1], bandwidth)
        row = {"size": c["size"], "precision": c["precision"], "topology": topo, "ours_step_s": common.median(o_steps),
               "trl_step_s": common.median(t_steps), "ours_tok_s": common.median(o_tok),
               "trl_tok_s": common.median(t_tok), "ours_steps": o_steps, "trl_steps": t_steps,
               "ours_phases_s": mine[-1]["phases"], "trl_threads": trl[key][-1]["threads"],
               "trl_phases_s": {k: common.median([ph[k] for ph in t_phases]) for k in (t_phases or [{}])[0]},
               "trl_param_dtype": trl[key][-1]["dtype"], "floor_compute_s": compute, "floor_bytes_s": moved,
               "floor_s": compute + moved}
        row["step_over_floor"] = row["ours_step_s"] / row["floor_s"]
        row["step_ratio"] = row["trl_step_s"] / row["ours_step_s"]  # > 1: ours is faster
        row["tok_ratio"] = row["ours_tok_s"] / row["trl_tok_s"]
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4M model, fp32 only, 1 round of 3 steps (~4 min)")
    p.add_argument("--sizes", nargs="+", choices=SIZES, help="default 4M quick, 4M 25M full")
    p.add_argument("--ours", nargs="+", default=["2x1"], metavar="RANKSxTHREADS",
                   help="our topologies: ranks x threads per rank (default 2x1, the recipe's; 1x2 = one rank, both "
                   "cores), each optionally +share: with trainer.prefix_share (the group's prompt computed once)")
    p.add_argument("--precisions", nargs="+", choices=["bf16", "fp32"], help="default fp32 quick, bf16 fp32 full")
    p.add_argument("--trl-huge-pages", action="store_true", help="run TRL with our huge-page setting too "
                   "(THP_MEM_ALLOC_ENABLE=1, a runtime default of ours; TRL's own default is without)")
    p.add_argument("--trl-threads", type=int, default=0, help="TRL's torch threads (0 = torch's default: all cores)")
    p.add_argument("--rounds", type=int, help="alternating rounds (default 1 quick, 3 full)")
    p.add_argument("--steps", type=int, help="steps per run incl. one warm-up (default 3 quick, 5 full)")
    p.add_argument("--smoke", action="store_true",
                   help=common.SMOKE_HELP + "; TRL's side runs only where benchmarks/.trl-venv exists (it is not "
                   "created in smoke mode: a multi-GB install)")
    p.add_argument("--name", default="vs_trl", help="result file name (benchmarks/results/NAME.json)")
    p.add_argument("--shard-size", type=int, default=0, help="our trainer.shard_size (default 0: the planner's "
                   "choice: 1 for 4M and 25M, every rank holds the model whole; 2 for the 0.5B shape at 2 ranks on a "
                   "24 GiB box, plain FSDP)")
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
    configs = [{"size": s, "precision": pr, "model": model_for(s), "workload": workload(s)} for s in a.sizes
               for pr in a.precisions]
    if a.smoke:
        rounds, steps, a.trl_threads = 1, 2, a.trl_threads
        configs = [dict(size="4M", precision="bf16", model=model_for("4M"),
                        workload=dict(WORKLOAD, prompts=2, n=2, max_new_tokens=4))]
    python, how = ensure_trl_venv(create=not a.smoke)
    if python is None and a.smoke:
        rows = run_ours(configs, steps, 0, a.ours[0], a.shard_size)
        print(f"smoke: our side ran ({rows[0]['step_s']} s/step); TRL side not run: {how}")
        common.write_result(a.name, {"trl_error": how, "ours": rows}, quick=a.quick)
        return
    if python is None:
        print(f"TRL side NOT RUN: {how}")
        common.write_result(a.name, {"trl_error": how, "tried": TRL_PINS}, quick=a.quick)
        return
    print(f"TRL environment: {how} ({TRL_VENV.relative_to(common.REPO)}: {' '.join(TRL_PINS)})")
    bandwidth = common.memory_bandwidth()
    print(f"memory bandwidth (copy_, best of 1 and {os.cpu_count()} threads): {bandwidth / 1e9:.1f} GB/s", flush=True)
    ours: dict[str, list] = {f"{c['size']}_{c['precision']}": [] for c in configs}
    trl: dict[str, list] = {k: [] for k in ours}
    failed: dict[str, str] = {}  # a topology that failed (its memory plan refused, a crash) leaves the comparison
    for r in range(rounds):
        for topo in (t for t in a.ours if t not in failed):
            try:
                for row in run_ours(configs, steps, r, topo, a.shard_size):
                    ours[f"{row['size']}_{row['precision']}"].append(row)
            except RuntimeError as e:  # the other topologies' runs still count
                failed[topo] = str(e)
                print(f"ours {topo} failed and is left out of the comparison: {e}", flush=True)
        for row in run_trl(python, configs, steps, a.trl_threads, a.trl_huge_pages):
            trl[f"{row['size']}_{row['precision']}"].append(row)
        print(f"round {r + 1}/{rounds} done", flush=True)
    compared = [t for t in a.ours if t not in failed]
    if not compared:
        sys.exit(f"every topology of ours failed: {failed}")
    rows = [dict(r, trl_huge_pages=a.trl_huge_pages) for r in compare(ours, trl, configs, compared, bandwidth)]
    report(rows, rounds, steps, a.quick, bandwidth, a.name, failed)


def report(rows: list[dict], rounds: int, steps: int, quick: bool, bandwidth: float, name: str = "vs_trl",
           failed: dict[str, str] | None = None) -> None:
    print(f"\nGRPO, KL with a reference, per model: {', '.join(f'{s}: {workload(s)}' for s in dict.fromkeys(r['size'] for r in rows))}; "
          f"{rounds} round(s) x {steps} steps (first of each run = warm-up)")
    print("hybrid_rl: RANKS x THREADS per rank (torchrun, vLLM rollout, FSDP2);  TRL: 1 process x "
          f"{rows[0]['trl_threads']} threads (its natural single-process set-up, transformers generate"
          f"{'; given our huge-page setting, --trl-huge-pages' if rows[0]['trl_huge_pages'] else ''})")
    print(common.table(rows, [("size", "model", "s"), ("precision", "precision", "s"), ("topology", "ours", "s"),
                              ("ours_step_s", "ours s/step", ".2f"), ("trl_step_s", "TRL s/step", ".2f"),
                              ("step_ratio", "TRL/ours time", ".2f"), ("ours_tok_s", "ours tok/s", ".0f"),
                              ("trl_tok_s", "TRL tok/s", ".0f"), ("floor_s", "our floor s", ".2f"),
                              ("step_over_floor", "ours/floor", ".2f")]))
    print(f"  floor = FLOPs at the measured matmul rate + bytes at {bandwidth / 1e9:.1f} GB/s (module doc)")
    for r in rows:
        o, t = r["ours_phases_s"], r["trl_phases_s"]
        print(f"  {r['size']} {r['precision']} ours {r['topology']}: " + ", ".join(f"{k} {v:.2f}" for k, v in o.items()
                                                                              if abs(v) > 5e-3))
        print(f"  {r['size']} {r['precision']} TRL     : " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
    for topo, why in (failed or {}).items():
        print(f"  ours {topo}: failed, not compared ({why.splitlines()[0]})")
    headline = [{"what": f"TRL/ours step time {r['size']} {r['precision']} ours {r['topology']}",
                 "value": r["step_ratio"]} for r in rows]
    # The targets: ours at least 1.5x faster than TRL at bf16 on 25M and 2x on the 0.5B shape (issue 45, raised from
    # issue 22's 1.5x); the 0.5B step within 2.5x of its compute + bandwidth floor.
    targets = [common.check(f"TRL/ours step time {r['size']} bf16 (ours {r['topology']})", r["step_ratio"],
                            2.0 if r["size"] == "0.5B" else 1.5, higher_is_better=True)
               for r in rows if r["size"] in ("25M", "0.5B") and r["precision"] == "bf16"]
    targets += [common.check(f"0.5B step / floor (ours {r['topology']})", r["step_over_floor"], 2.5,
                             higher_is_better=False) for r in rows if r["size"] == "0.5B"]
    common.write_result(name, {"rows": rows, "headline": headline, "targets": targets,
                                   "workloads": {r["size"]: workload(r["size"]) for r in rows}, "rounds": rounds,
                                   "steps": steps, "trl_pins": TRL_PINS, "bandwidth_bytes_s": bandwidth,
                                   "failed": failed or {},
                                   "setups": {"ours": "RANKSxTHREADS, torchrun, vLLM rollout, FSDP2",
                                              "trl": "1 process, torch default threads, transformers generate"}},
                        quick=quick)


if __name__ == "__main__":
    main()
