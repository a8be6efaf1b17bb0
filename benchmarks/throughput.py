"""Throughput of whole RL steps: where a step's time goes, tokens/s, and the step against its compute floor.

    python benchmarks/throughput.py [--quick] [--recipe grpo] [--hidden 256 --layers 4 --heads 4 \\
        --kv-heads 2 --intermediate 1024 | --model PATH] [--nproc 2] [--prompts 4] [--n 8] \\
        [--max-new-tokens 64] [--steps 3] [--set key=value ...]

Runs the trainer (`build` -> `Trainer.fit`, as `hybrid_rl.train` does) for `--steps` steps under
torchrun and reads the trainer's own `timing/*_s` metrics from metrics.jsonl; the first step (vLLM
start-up, first sync) is a warm-up and is not counted; figures are medians over the other steps.

* Phases and their share of the step. The trainer's `timing/rollout_s` contains the sync and the
  switch, so they are split out here: generate = rollout - sync - switch (generation plus leaving
  rollout mode and sharing the samples), and other = step - everything timed.
* Tokens/s: generated (generated tokens / generate seconds), trained (prompt + response tokens /
  update seconds), whole step (prompt + response tokens / step seconds).
* Compute floor: the step's FLOPs -- policy forward+backward 6*N*tokens per epoch, old-log-prob and
  reference forwards 2*N*tokens each, generation 2*N*generated tokens, critic forward and
  forward+backward when on (N = non-embedding params + lm_head, tokens = prompt + response) --
  divided by this machine's matmul rate in the same dtype: a square `torch.matmul` timed on every
  rank at once, with the ranks' own thread count, before and after the run (best of each rank,
  summed over ranks). Printed: step time / floor.

Nothing here is CPU-specific: on CUDA, torchrun ranks use their GPU and the matmul is timed there.
Writes benchmarks/results/<name>.json and <name>.png (default name: throughput).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PHASES = ("generate", "sync", "switch", "old_logp", "reference", "critic", "reward_model", "reward_wait", "update",
          "other")
TIMED = ("rollout", "old_logp", "reference", "critic", "reward_model", "reward_wait", "update")


# =================================================================================================
# Worker (under torchrun): build -> fit -> close for each run, matmul rates around each.
# =================================================================================================


def _rates(dtypes: list[str]) -> dict[str, float]:
    """This machine's matmul FLOP/s per dtype: every rank times at once; per-rank bests, summed over ranks."""
    import torch
    import torch.distributed as dist

    from hybrid_rl.distributed.collectives import all_reduce_sum
    from hybrid_rl.model.loading import DTYPES

    out = {}
    for name in dtypes:
        dist.barrier()
        out[name] = all_reduce_sum([common.matmul_rate(DTYPES[name], n=1024, seconds=1.0)])[0]
    out["threads_per_rank"] = torch.get_num_threads()
    return out


def worker(runs: list[dict]) -> None:
    import logging

    import torch.distributed as dist

    from hybrid_rl.build import build
    from hybrid_rl.config import load_config, to_dict
    from hybrid_rl.distributed.mesh import init_distributed
    from hybrid_rl.trainer import Trainer

    logging.basicConfig(level=logging.WARNING)
    results = []
    for run in runs:
        cfg = load_config(run["recipe"], run["overrides"])
        dims = init_distributed(cfg.rollout.tp)
        dtypes = sorted({cfg.model.dtype, cfg.rollout.dtype})
        before = _rates(dtypes)
        t0 = time.perf_counter()
        trainer = Trainer(build(cfg))
        try:
            trainer.fit()
        finally:
            trainer.close()
        wall = time.perf_counter() - t0
        after = _rates(dtypes)
        results.append({"name": run["name"], "config": to_dict(cfg), "world": dims.world, "wall_s": wall,
                        "rates_before": before, "rates_after": after})
    if dist.get_rank() == 0:
        common.worker_write({"runs": results})
    dist.destroy_process_group()


# =================================================================================================
# Driver side: launch, then read metrics.jsonl
# =================================================================================================


def run_overrides(model: str, out_dir: Path, *, prompts: int, n: int, max_new_tokens: int, steps: int,
                  extra: list[str]) -> list[str]:
    train, _ = common.task_files()
    base = {
        "model.path": model, "data.train_files": f"[{train}]", "data.prompts_per_step": prompts, "rollout.n": n,
        "rollout.max_new_tokens": max_new_tokens, "trainer.total_steps": steps, "trainer.output_dir": str(out_dir),
        "trainer.show_progress": "false", "trainer.export": "false", "trainer.resume": "never",
        "optim.warmup_steps": 0,
    }
    return [f"{k}={v}" for k, v in base.items()] + list(extra)


def launch(runs: list[dict], *, nproc: int, tag: str, threads: int | None = None) -> list[dict]:
    """Run `runs` ({name, recipe, overrides}) in one torchrun launch (`threads` compute threads per rank, default
    the environment's); returns each run's summary."""
    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    got = common.torchrun(__file__, ["--worker", json.dumps(runs)], nproc=nproc, timeout=3600, tag=tag,
                          env=env)["runs"]
    return [summarize(r) for r in got]


def summarize(run: dict) -> dict:
    """Medians over the steps after the first: phase seconds and shares, tokens/s, FLOPs floor."""
    from hybrid_rl.metrics.jsonl import read_records

    cfg = run["config"]
    records = read_records(Path(cfg["trainer"]["output_dir"]) / "metrics.jsonl")
    steps = [r for r in records if "timing/step_s" in r]
    measured = steps[1:] or steps  # the first step (vLLM start-up, first sync) is a warm-up
    per_step = [_phases(r) for r in measured]
    phases = {p: common.median([s[p] for s in per_step]) for p in PHASES}
    step_s = common.median([r["timing/step_s"] for r in measured])
    samples = cfg["data"]["prompts_per_step"] * cfg["rollout"]["n"]
    all_tokens = common.median([r["throughput/tokens_per_s"] * r["timing/step_s"] for r in measured])
    gen_tokens = common.median([r["response/length_mean"] * samples for r in measured])
    counts = common.param_counts(cfg["model"]["path"])
    flops = _flops(cfg, counts["flops_n"], all_tokens, gen_tokens)
    rates = {k: max(run["rates_before"][k], run["rates_after"][k]) for k in run["rates_before"]
             if k != "threads_per_rank"}
    floor_s = sum(f / rates[dtype] for f, dtype in flops.values())
    return {
        "name": run["name"], "model": cfg["model"]["path"], "params": counts["total"], "flops_n": counts["flops_n"],
        "world": run["world"], "threads_per_rank": run["rates_before"]["threads_per_rank"],
        "recipe": cfg["algorithm"]["name"], "model_dtype": cfg["model"]["dtype"],
        "rollout_dtype": cfg["rollout"]["dtype"], "prompts": cfg["data"]["prompts_per_step"],
        "n": cfg["rollout"]["n"], "max_new_tokens": cfg["rollout"]["max_new_tokens"],
        "micro_batch_tokens": cfg["trainer"]["micro_batch_tokens"], "steps_measured": len(measured),
        "step_s": step_s, "step_samples_s": [r["timing/step_s"] for r in measured],
        "step_tokens_samples": [r["throughput/tokens_per_s"] * r["timing/step_s"] for r in measured],
        "phases_s": phases, "shares": {p: v / step_s for p, v in phases.items()},
        "generated_tokens": gen_tokens, "all_tokens": all_tokens,
        "generated_tok_s": gen_tokens / phases["generate"] if phases["generate"] else None,
        "trained_tok_s": all_tokens / phases["update"] if phases["update"] else None,
        "step_tok_s": all_tokens / step_s,
        "flops": {k: f for k, (f, _) in flops.items()}, "matmul_flop_s": rates,
        "matmul_rates_before": run["rates_before"], "matmul_rates_after": run["rates_after"],
        "floor_s": floor_s, "step_over_floor": step_s / floor_s, "wall_s": run["wall_s"],
        "reward_mean": common.median([r.get("reward/mean") or 0.0 for r in measured]),
    }


def _phases(r: dict) -> dict[str, float]:
    t = {k: r.get(f"timing/{k}_s") or 0.0 for k in (*TIMED, "sync", "switch")}
    out = {"generate": t["rollout"] - t["sync"] - t["switch"], "sync": t["sync"], "switch": t["switch"]}
    out.update({k: t[k] for k in TIMED if k != "rollout"})
    out["other"] = r["timing/step_s"] - sum(out.values())
    return out


def _flops(cfg: dict, n: int, tokens: float, gen_tokens: float) -> dict[str, tuple[float, str]]:
    """FLOPs of one step by pass, each with the dtype it runs in."""
    from hybrid_rl.config import AlgorithmConfig

    a, train, roll = cfg["algorithm"], cfg["model"]["dtype"], cfg["rollout"]["dtype"]
    out = {"generate": (2 * n * gen_tokens, roll), "update": (6 * n * tokens * a["ppo_epochs"], train)}
    if not AlgorithmConfig(**a).old_logp_from_update:
        out["old_logp"] = (2 * n * tokens, train)
    if a["use_reference"]:
        out["reference"] = (2 * n * tokens, train)
    if a["use_critic"]:
        out["critic"] = (2 * n * tokens + 6 * n * tokens * a["ppo_epochs"], "float32")
    return out


def print_run(s: dict) -> None:
    print(f"\n{s['recipe']} on {Path(s['model']).name} ({s['params'] / 1e6:.1f}M params, N={s['flops_n'] / 1e6:.1f}M), "
          f"{s['world']} ranks x {s['threads_per_rank']} thread(s); {s['prompts']} prompts x {s['n']} samples, "
          f"<= {s['max_new_tokens']} new tokens; model {s['model_dtype']}, rollout {s['rollout_dtype']}; "
          f"medians of {s['steps_measured']} steps after a warm-up step")
    rows = [{"phase": p, "s": s["phases_s"][p], "share": 100 * s["shares"][p]} for p in PHASES
            if abs(s["phases_s"][p]) > 1e-4]
    rows.append({"phase": "step", "s": s["step_s"], "share": 100.0})
    print(common.table(rows, [("phase", "phase", "s"), ("s", "seconds", ".3f"), ("share", "% of step", ".1f")]))
    gen = s["generated_tok_s"]
    print(f"  tokens/s: generated {gen:.0f} ({s['generated_tokens']:.0f} tokens), trained {s['trained_tok_s']:.0f}, "
          f"whole step {s['step_tok_s']:.0f} ({s['all_tokens']:.0f} prompt+response tokens)")
    rates = ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in s["matmul_flop_s"].items())
    print(f"  compute floor: {sum(s['flops'].values()) / 1e9:.1f} GFLOP at {rates} (all ranks) = {s['floor_s']:.3f} s;"
          f" step / floor = {s['step_over_floor']:.1f}x")


def plot_shares(summaries: list[dict], png: Path, title: str) -> None:
    """Horizontal stacked bars: each run's step split into its phases (share of the step)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 1.8 + 0.6 * len(summaries)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    palette = ["#4c72b0", "#dd8452", "#c44e52", "#55a868", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974",
               "#64b5cd"]
    colors, labelled = dict(zip(PHASES, palette, strict=True)), set()
    for i, s in enumerate(summaries):
        left = 0.0
        for p in PHASES:
            share = max(0.0, 100 * s["shares"][p])
            if share <= 0:
                continue
            ax.barh(i, share, left=left, color=colors[p], label=None if p in labelled else p)
            labelled.add(p)
            if share > 6:
                ax.text(left + share / 2, i, f"{share:.0f}%", ha="center", va="center", fontsize=8, color="white")
            left += share
    ax.set_yticks(range(len(summaries)), [f"{s['name']}\n{s['step_s']:.2f} s/step" for s in summaries])
    ax.set_xlabel("% of step time")
    ax.set_xlim(0, 100)
    ax.set_title(title)
    fig.legend(loc="outside lower center", ncols=6, fontsize=8)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {common._shown(png)}")


def model_from_args(a) -> str:
    if a.model:
        return a.model
    return str(common.tiny_model(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 steps of 4 prompts x 8 samples x 64 tokens (~2 min)")
    p.add_argument("--recipe", default="grpo")
    p.add_argument("--model", help="any Hugging Face model folder (else a tiny model from the size flags)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--nproc", type=int, default=2, help="torchrun ranks")
    p.add_argument("--prompts", type=int, help="prompts per step (default 4 quick, 8 full)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, help="default 64 quick, 128 full")
    p.add_argument("--steps", type=int, help="steps including the warm-up step (default 3 quick, 6 full)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--name", default="throughput", help="result file name")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.prompts, a.n, a.max_new_tokens, a.steps = 2, 2, 4, 2
    if a.worker:
        from hybrid_rl.utils.env import set_runtime_defaults

        set_runtime_defaults()
        worker(json.loads(a.worker))
        return
    a.prompts = a.prompts or (4 if a.quick else 8)
    a.max_new_tokens = a.max_new_tokens or (64 if a.quick else 128)
    a.steps = a.steps or (3 if a.quick else 6)
    model = model_from_args(a)
    out = common.CACHE / "runs" / a.name
    overrides = run_overrides(model, out, prompts=a.prompts, n=a.n, max_new_tokens=a.max_new_tokens, steps=a.steps,
                              extra=a.set)
    _clean(out)
    [s] = launch([{"name": a.recipe, "recipe": a.recipe, "overrides": overrides}], nproc=a.nproc, tag=a.name)
    print_run(s)
    plot_shares([s], common.RESULTS / f"{a.name}.png", f"{a.recipe}: share of one RL step by phase")
    headline = [{"what": "step time / compute floor", "value": s["step_over_floor"]},
                {"what": "whole-step tokens/s", "value": s["step_tok_s"]},
                {"what": "generated tokens/s", "value": s["generated_tok_s"]},
                {"what": "trained tokens/s", "value": s["trained_tok_s"]}]
    headline += [{"what": f"share of step: {p}", "value": s["shares"][p]} for p in PHASES if s["shares"][p] > 0.05]
    common.write_result(a.name, {"run": s, "headline": headline, "overrides": overrides, "nproc": a.nproc},
                        quick=a.quick)


def _clean(out: Path) -> None:
    """A fresh output folder: metrics.jsonl would otherwise continue an earlier run's file."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
