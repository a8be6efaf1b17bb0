"""Real scale on one box: Qwen2.5-shaped models through `hybrid_rl.train`, each phase's measured peak beside the plan.

    python benchmarks/scale.py [--runs full_0.5B lora_3B largest_lora lora_3B_merged largest_full_8bit] [--nproc 2]
                               [--steps 2] [--plan-only]

* `full_0.5B`: Qwen2.5-0.5B's shape, full fine-tuning, GRPO as shipped (`recipes/grpo.yaml`) with 4 prompts x 4
  samples x 32 new tokens, every other setting the recipe's default.
* `lora_3B`: Qwen2.5-3B's shape, `model.lora.rank=16`, the same batch, plus exactly the settings the memory
  planner recommends for this machine (`python -m hybrid_rl.plan ...`, its "all on one command line" line).
* `largest_lora`: from the largest Qwen2.5 shape (7B, 3B, 1.5B, 0.5B) down, the first that the planner says
  fits (with its recommended settings) and that then trains a LoRA step; a shape trained by `lora_3B` in the
  same run counts.
* `lora_3B_merged`: `lora_3B` with `model.lora.sync=merged` (the planner's settings of `lora_3B`): step time and
  peaks of adapter sync (the default, `lora_3B`) against merged weights.
* `largest_full_8bit`: from the largest shape down, the first whose *full fine-tuning* step with
  `optim.name=adamw8bit` the planner says fits (with its recommended settings), then trained.

`--plan-only`: the planner's verdicts (and recommended settings) for the runs asked, no training (for a machine
without the memory free to run them).

Weights are random, saved in bf16 as real checkpoints are (`qwen_shapes.py`; nothing is downloaded). Per phase
the measured peak is the largest over steps and ranks of the trainer's own `memory/<phase>/peak_gib` (each
rank's VmHWM, reset at each phase; start-up from process start), compared with `memory/<phase>/plan_gib`: the
target is every phase within 15% of its plan. Step 1 has no AdamW state yet (the optimizer creates it at its
first step), so the comparison uses steps 2 and later, where the plan's steady state holds; step 1's figures are
in the JSON too. Not in `make bench --quick` (these runs take minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import qwen_shapes  # noqa: E402

BATCH = ["data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=32"]
TOLERANCE = 0.15
PHASE_TIMES = ("rollout", "sync", "switch", "old_logp", "reference", "update")


def base_overrides(model: Path, out: Path, steps: int) -> list[str]:
    return [f"model.path={model}", f"data.train_files=[{common.task_files()[0]}]", *BATCH, f"trainer.total_steps={steps}",
            f"trainer.output_dir={out}", "trainer.resume=never", "trainer.show_progress=false", "trainer.export=false"]


def recommended(overrides: list[str], nproc: int, device_gib: float | None = None) -> tuple[bool, list[str], str]:
    """(fits as asked, the planner's settings that make it fit, its verdict text) for this machine (the memory
    available now, or `device_gib` per rank)."""
    cmd = [sys.executable, "-m", "hybrid_rl.plan", "--config-name=grpo", *overrides, "--world", str(nproc)]
    cmd += ["--device-gib", str(device_gib)] if device_gib else []
    proc = subprocess.run(cmd, cwd=common.REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"planner failed: {proc.stderr[-2000:]}")
    verdict = proc.stdout[proc.stdout.index("FITS") if proc.returncode == 0 else proc.stdout.index("DOES NOT FIT"):]
    line = next((x for x in verdict.splitlines() if "all on one command line" in x), "")
    # "..., on N ranks:" needs more ranks than this run has: nothing to apply here
    settings = line.split(":", 1)[1].split() if line and ", on " not in line else []
    return proc.returncode == 0, settings, verdict.split("\n  note:")[0]


def train(name: str, overrides: list[str], nproc: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", "-m",
           "hybrid_rl.train", "--config-name=grpo", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=common.REPO, capture_output=True, text=True, timeout=5400)
    log = common.CACHE / "logs" / f"scale_{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if \
        (out / "metrics.jsonl").exists() else []
    steps = [s for s in steps if s.get("step", 0) > 0 and "timing/step_s" in s]
    return {"name": name, "ok": proc.returncode == 0, "exit": proc.returncode, "wall_s": time.time() - t0,
            "overrides": overrides, "steps": steps, "log": str(log)}


def compare(run: dict) -> list[dict]:
    """Per phase: plan, measured peak over steps >= 2 (steady state; start-up from step 1), and their ratio."""
    rows = []
    phases = sorted({k.split("/")[1] for s in run["steps"] for k in s if k.endswith("/plan_gib")})
    for phase in phases:
        key = f"memory/{phase}/peak_gib"
        steady = [s for s in run["steps"] if s["step"] >= 2 or phase == "startup"]
        measured = max((s[key] for s in steady if key in s), default=None)
        plan = next(s[f"memory/{phase}/plan_gib"] for s in run["steps"] if f"memory/{phase}/plan_gib" in s)
        step1 = next((s[key] for s in run["steps"] if s["step"] == 1 and key in s), None)
        if measured is None:
            continue
        rows.append({"run": run["name"], "phase": phase, "plan_gib": plan, "measured_gib": measured,
                     "step1_gib": step1, "ratio": measured / plan})
    return rows


def timings(run: dict) -> dict:
    later = [s for s in run["steps"] if s["step"] >= 2] or run["steps"]
    return {k: common.median([s.get(f"timing/{k}_s", 0.0) for s in later]) for k in ("step", *PHASE_TIMES)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=["full_0.5B", "lora_3B", "largest_lora"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--plan-only", action="store_true", help="plan the runs asked, train none")
    p.add_argument("--device-gib", type=float, default=None,
                   help="with --plan-only: plan for this much memory per rank (default: what is available now)")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP + " (the full run on the 4M model only)")
    a = p.parse_args()
    runs, plans, largest = [], {}, None
    if a.plan_only:
        plan_only(a)
        return
    if a.smoke:
        out = common.CACHE / "scale" / "smoke"
        runs.append(train("full_4M", base_overrides(common.sized_model("4M"), out, a.steps), a.nproc, out))
        a.runs = []
    if "full_0.5B" in a.runs:
        out = common.CACHE / "scale" / "full_0.5B"
        runs.append(train("full_0.5B", base_overrides(qwen_shapes.folder("0.5B"), out, a.steps), a.nproc, out))
    if "lora_3B" in a.runs:
        runs.append(_lora("3B", a, plans))
        if runs[-1]["ok"]:
            largest = "3B"
    if "largest_lora" in a.runs:
        for size in ("7B", "3B", "1.5B", "0.5B"):
            if size == largest:  # trained above, in this run
                break
            _, settings, _ = _plan_lora(size, a, plans)
            if not _fits_after(size, settings, a, plans):
                continue  # the planner says no: not run (a run would be killed by the kernel, or swap)
            run = _lora(size, a, plans)
            runs.append(run)
            if run["ok"]:
                largest = size
                break
    if "lora_3B_merged" in a.runs:
        if "3B" not in plans:
            _plan_lora("3B", a, plans)
        out = common.CACHE / "scale" / "lora_3B_merged"
        runs.append(train("lora_3B_merged", base_overrides(qwen_shapes.folder("3B"), out, a.steps) + [
            "model.lora.rank=16", "model.lora.sync=merged", *plans["3B"]["recommended"]], a.nproc, out))
    eight = None
    if "largest_full_8bit" in a.runs:
        if (size := _largest_8bit_plan(a, plans)) is not None:
            out = common.CACHE / "scale" / f"full8bit_{size}"
            run = train(f"full8bit_{size}", _full8bit_overrides(size, a, plans[f"full8bit_{size}"]["recommended"],
                                                                weights=True), a.nproc, out)
            runs.append(run)
            eight = size if run["ok"] else None
    report(runs, plans, largest, a, eight)


def _model(size: str, a, *, weights: bool) -> Path:
    """Planning reads the config only; training needs the weights (written on first use: ~15 GB at 7B, so never
    for a shape that is only planned)."""
    return qwen_shapes.folder(size) if weights and not a.plan_only else qwen_shapes.config_folder(size)


def _full8bit_overrides(size: str, a, extra: list[str], *, weights: bool = False) -> list[str]:
    out = common.CACHE / "scale" / f"full8bit_{size}"
    return base_overrides(_model(size, a, weights=weights), out, a.steps) + ["optim.name=adamw8bit", *extra]


def _largest_8bit_plan(a, plans: dict) -> str | None:
    """The largest shape whose full fine-tuning step with 8-bit AdamW the planner fits here (its settings applied)."""
    for size in ("7B", "3B", "1.5B", "0.5B"):
        fits, settings, verdict = recommended(_full8bit_overrides(size, a, []), a.nproc, a.device_gib)
        entry = plans[f"full8bit_{size}"] = {"fits_as_shipped": fits, "recommended": settings, "verdict": verdict}
        print(f"plan full fine-tuning {size} with adamw8bit: {verdict.splitlines()[0]}", flush=True)
        if not fits and settings:
            fits, _, verdict = recommended(_full8bit_overrides(size, a, settings), a.nproc, a.device_gib)
            entry.update(fits_with_recommended=fits, verdict_with_recommended=verdict)
            print(f"  with {' '.join(settings)}: {verdict.splitlines()[0]}", flush=True)
        if fits:
            return size
    return None


def plan_only(a) -> None:
    """The planner's verdicts for the runs asked (each with and without its recommended settings), no training."""
    plans = {}
    if "largest_full_8bit" in a.runs:
        plans["largest_full_8bit"] = _largest_8bit_plan(a, plans)
    for size in ("3B",) if {"lora_3B", "lora_3B_merged"} & set(a.runs) else ():
        for mode in ("adapter", "merged"):
            fits, settings, verdict = recommended(_lora_overrides(size, a, [f"model.lora.sync={mode}"]), a.nproc,
                                                  a.device_gib)
            plans[f"lora_{size}_{mode}"] = {"fits_as_shipped": fits, "recommended": settings, "verdict": verdict}
            print(f"plan LoRA {size} sync={mode}: {verdict.splitlines()[0]}", flush=True)
    common.write_result("scale_plan", {"plans": plans, "nproc": a.nproc, "device_gib": a.device_gib}, quick=False)


def _lora_overrides(size: str, a, extra: list[str], *, weights: bool = False) -> list[str]:
    out = common.CACHE / "scale" / f"lora_{size}"
    return base_overrides(_model(size, a, weights=weights), out, a.steps) + ["model.lora.rank=16", *extra]


def _plan_lora(size: str, a, plans: dict) -> tuple[bool, list[str], str]:
    fits, settings, verdict = recommended(_lora_overrides(size, a, []), a.nproc)
    plans[size] = {"fits_as_shipped": fits, "recommended": settings, "verdict": verdict}
    print(f"plan LoRA {size}: {verdict.splitlines()[0]}", flush=True)
    return fits, settings, verdict


def _fits_after(size: str, settings: list[str], a, plans: dict) -> bool:
    """Does the plan fit once its recommended settings are applied?"""
    if plans[size]["fits_as_shipped"]:
        return True
    fits, _, verdict = recommended(_lora_overrides(size, a, settings), a.nproc)
    plans[size]["fits_with_recommended"] = fits
    plans[size]["verdict_with_recommended"] = verdict
    return fits


def _lora(size: str, a, plans: dict) -> dict:
    if size not in plans:
        _plan_lora(size, a, plans)
    settings = plans[size]["recommended"]
    out = common.CACHE / "scale" / f"lora_{size}"
    return train(f"lora_{size}", _lora_overrides(size, a, settings, weights=True), a.nproc, out)


def report(runs: list[dict], plans: dict, largest: str | None, a, eight: str | None = None) -> None:
    rows = [r for run in runs if run["ok"] for r in compare(run)]
    print(common.table(rows, [("run", "run", "s"), ("phase", "phase", "s"), ("plan_gib", "plan GiB", ".2f"),
                              ("measured_gib", "measured GiB", ".2f"), ("step1_gib", "step 1 GiB", ".2f"),
                              ("ratio", "measured/plan", ".3f")]))
    for run in runs:
        status = "ok" if run["ok"] else f"FAILED (exit {run['exit']}; {run['log']})"
        print(f"{run['name']}: {status}; " + ", ".join(f"{k} {v:.1f} s" for k, v in timings(run).items()))
    targets = [common.check(f"{r['run']} {r['phase']}: |measured/plan - 1|", abs(r["ratio"] - 1), TOLERANCE,
                            higher_is_better=False) for r in rows]
    targets += [common.check(f"{run['name']} trains {a.steps} steps", float(run["ok"]), 1.0, higher_is_better=True,
                             unit="") for run in runs]
    print(f"largest Qwen2.5 shape that trains a LoRA step here: {largest or 'none'}")
    if "largest_full_8bit" in a.runs:
        print(f"largest Qwen2.5 shape that trains a full fine-tuning step with adamw8bit here: {eight or 'none'}")
    common.write_result("scale", {"runs": [{**r, "timings": timings(r)} for r in runs], "phases": rows,
                                  "plans": plans, "largest_lora": largest, "largest_full_8bit": eight,
                                  "targets": targets,
                                  "headline": [{"what": f"{r['run']} {r['phase']} measured/plan", "value": r["ratio"]}
                                               for r in rows]}, quick=False)


if __name__ == "__main__":
    main()
