"""`make demo`: RL on two CPU ranks that visibly learns, from nothing but this repository.

    python -m hybrid_rl.demo [--task digits|tools] [--algo grpo|ppo] [--nproc 2] [--steps 100] [--out outputs/demo]
                             [--mode colocated|sidecar] [--max-staleness K] [--arch dense|moe]

1. builds a tiny random Qwen2-style model and its tokenizer offline (`--arch moe`: a Qwen3-MoE, 8 experts, top-2,
   trained with the `grpo_moe` recipe: GSPO with rollout routing replay);
2. writes the task as JSONL: `digits` (see `task.py`: pick the third of six digits, answer boxed) or `tools`
   (see `tools_task.py`: a product of two 3-digit numbers, which one call of the sandboxed `python` tool answers);
3. supervised warm-up on the answer *format* only (a random digit of the list, boxed), or for `tools` on a mix of
   conversations of which only some call the tool (`tools_warmup.py`);
4. launches `torchrun -m hybrid_rl.train --config-name=<algo>` with the hybrid engine, or with
   `--mode sidecar` a vLLM server beside the trainer (and a private etcd for it), asynchronous with
   `--max-staleness K` > 0 (generation runs up to K policy versions ahead of training);
5. prints the held-out reward before and after training, and where the logs, checkpoint and plot are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()


def demo_overrides(*, model: Path, data: Path, out: Path, steps: int, prompts: int, val_every: int,
                   extra: dict[str, object] | None = None) -> list[str]:
    """The training settings of the demo (small batches, fp32: faster than bf16 at this model size on CPU); `extra`
    adds settings or replaces these."""
    settings: dict[str, object] = {
        "model.path": model, "data.train_files": f"[{data / 'train.jsonl'}]",
        "data.val_files": f"[{data / 'val.jsonl'}]", "data.val_prompts": 64, "data.prompts_per_step": prompts,
        "rollout.n": 8, "rollout.max_new_tokens": 8, "model.dtype": "float32", "rollout.dtype": "float32",
        "optim.lr": "5e-4", "optim.warmup_steps": 0, "critic.lr": "1e-3", "algorithm.kl_coef": 0.001,
        "trainer.micro_batch_tokens": 512, "trainer.total_steps": steps, "trainer.val_every": val_every,
        "trainer.save_every": steps, "trainer.output_dir": out, "trainer.resume": "never", "reward.num_workers": 1,
    }
    settings.update(extra or {})
    return [f"{k}={v}" for k, v in settings.items()]


def base_model(root: Path, log, arch: str = "dense") -> Path:
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    base = root / ("base_model" if arch == "dense" else f"{arch}_base_model")
    if not (base / "config.json").exists():
        log(f"building a tiny random {ARCHS[arch][1]} and its tokenizer ...")
        build_tiny_model(base, TinySpec(**ARCHS[arch][0]))
    return base


def prepare(root: Path, *, log=print, arch: str = "dense") -> tuple[Path, Path]:
    """Tiny model, task data and the warmed-up model (each built once, then reused)."""
    from hybrid_rl.demo.task import write_task
    from hybrid_rl.demo.warmup import supervised_warmup

    data, warm = root / "data", root / ("warm_model" if arch == "dense" else f"{arch}_warm_model")
    if not (data / "val.jsonl").exists():
        write_task(data, n_train=2048, n_val=64, fixed_position=2)
    base = base_model(root, log, arch)
    if not (warm / "config.json").exists():
        log("supervised warm-up on the answer format (about a minute) ...")
        t0 = time.perf_counter()
        supervised_warmup(base, data / "train.jsonl", warm, epochs=10, batch_size=32, lr=1e-3, log=log)
        log(f"warm-up done in {time.perf_counter() - t0:.0f}s")
    return warm, data


# `--arch`: the tiny model's kind, as (TinySpec arguments, what the log calls it)
ARCHS = {"dense": ({}, "Qwen2-style model (2 layers, 128 wide)"),
         "moe": ({"arch": "qwen3_moe"}, "Qwen3-MoE (2 layers, 128 wide, 8 experts, top-2)")}
RECIPES = {"dense": None, "moe": "grpo_moe"}  # `--arch moe` trains with this recipe whatever `--algo` says
TOOLS_CALL_SHARE = 0.3  # of the warm-up's conversations that call the tool: the rest box a guess
TOOLS_WARMUP_STEPS = 250


def prepare_tools(root: Path, *, log=print, warmup_batch: int = 32, warmup_steps: int = TOOLS_WARMUP_STEPS,
                  arch: str = "dense") -> tuple[Path, Path]:
    """The tools task's data and warmed-up model (on the same tiny base model), each built once; `warmup_batch`:
    conversations per warm-up step, `warmup_steps` its steps (the test shrinks both: its cost is most of the test's)."""
    from hybrid_rl.demo.tools_task import write_tools_task
    from hybrid_rl.demo.tools_warmup import tools_warmup

    data, warm = root / "tools_data", root / ("tools_warm_model" if arch == "dense" else f"tools_{arch}_warm_model")
    if not (data / "val.jsonl").exists():
        write_tools_task(data, n_train=2048, n_val=64)
    base = base_model(root, log, arch)
    if not (warm / "config.json").exists():
        log(f"supervised warm-up on the tool-call format ({warmup_steps} steps, {TOOLS_CALL_SHARE:.0%} of the "
            "conversations call the tool) ...")
        t0 = time.perf_counter()
        tools_warmup(base, data / "train.jsonl", warm, call_share=TOOLS_CALL_SHARE, steps=warmup_steps, lr=3e-3,
                     batch_size=warmup_batch, log=log)
        log(f"warm-up done in {time.perf_counter() - t0:.0f}s")
    return warm, data


@dataclass(frozen=True)
class DemoTask:
    prepare: Callable[..., tuple[Path, Path]]  # (root, log=) -> (warmed-up model, data folder)
    settings: dict[str, object]  # training settings beside `demo_overrides`'
    plot_keys: tuple[str, ...]
    title: str
    steps: int  # the default of --steps
    prompts: int  # the default of --prompts


# The tools task: the budget holds the call (74 tokens), the tool's message (16) and the boxed answer (11); two model
# turns and one call are all the task needs; fewer tool workers than cores leave room for vLLM and the trainer.
TASKS = {
    "digits": DemoTask(prepare, {}, ("val/reward_mean", "reward/mean", "actor/kl", "response/length_mean"),
                       "the demo task", steps=80, prompts=32),
    "tools": DemoTask(prepare_tools, {
        "rollout.tools": "[python]", "rollout.max_new_tokens": 128, "rollout.multi_turn.max_turns": 2,
        "rollout.multi_turn.max_tool_calls": 1, "rollout.multi_turn.tool_workers": 1,
        "trainer.micro_batch_tokens": 2048}, ("val/reward_mean", "val/rollout/tool_call_rate", "reward/mean",
                                              "rollout/tool_call_rate"), "the tools task", steps=20, prompts=8),
}


def sidecar_overrides(*, etcd: str, max_staleness: int) -> list[str]:
    """Sidecar mode on this machine: the server on a free port, a small KV cache (the model is tiny)."""
    from hybrid_rl.distributed.mesh import free_port

    return ["rollout.mode=sidecar", f"sidecar.etcd={etcd}", f"sidecar.port={free_port()}", "rollout.kv_cache_gb=0.25",
            f"rollout.max_staleness={max_staleness}"]


def held_out(metrics: Path, key: str = "val/reward_mean") -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="digits", choices=sorted(TASKS),
                   help="digits: pick a digit from a list; tools: a product that one python tool call answers")
    p.add_argument("--algo", default="grpo", choices=["grpo", "ppo"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, help="training steps (default: digits 80, tools 20)")
    p.add_argument("--prompts", type=int, help="prompts per step, 8 samples each (default: digits 32, tools 8)")
    p.add_argument("--val-points", type=int, default=5, help="held-out scores after the first (every steps/N steps)")
    p.add_argument("--out", default="outputs/demo")
    p.add_argument("--mode", default="colocated", choices=["colocated", "sidecar"],
                   help="rollouts from the in-process engine, or from a vLLM server beside the trainer")
    p.add_argument("--max-staleness", type=int, default=0,
                   help="sidecar mode: asynchronous training, generation up to K policy versions ahead")
    p.add_argument("--arch", default="dense", choices=["dense", "moe"],
                   help="moe: a tiny Qwen3-MoE trained with the grpo_moe recipe (GSPO, rollout routing replay)")
    a = p.parse_args(argv)
    if a.max_staleness and a.mode != "sidecar":
        p.error("--max-staleness needs --mode sidecar")
    if a.arch == "moe" and (a.algo != "grpo" or a.mode != "colocated"):
        p.error("--arch moe runs the grpo_moe recipe, colocated (routing replay is colocated only)")
    root = Path(a.out).resolve()
    task = TASKS[a.task]
    a.steps = a.steps or task.steps
    a.prompts = a.prompts or task.prompts
    warm, data = task.prepare(root, arch=a.arch)
    a.algo = RECIPES[a.arch] or a.algo
    name = a.algo if a.mode == "colocated" else f"{a.algo}_sidecar_k{a.max_staleness}"
    run = root / (name if a.task == "digits" else f"{a.task}_{name}")
    overrides = demo_overrides(model=warm, data=data, out=run, steps=a.steps, prompts=a.prompts,
                               val_every=max(1, a.steps // a.val_points), extra=task.settings)
    t0 = time.perf_counter()
    with _etcd(run, a.mode == "sidecar") as etcd:
        if etcd is not None:
            overrides += sidecar_overrides(etcd=etcd.endpoint, max_staleness=a.max_staleness)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
               "-m", "hybrid_rl.train", f"--config-name={a.algo}", *overrides]
        print("running:", " ".join(cmd[2:]), flush=True)
        rc = subprocess.call(cmd, env=dict(os.environ))
    if rc != 0:
        print(f"training failed (exit code {rc})", file=sys.stderr)
        return rc
    from hybrid_rl.metrics import plot_metrics

    png = plot_metrics(run / "metrics.jsonl", run / "reward_curve.png", keys=task.plot_keys,
                       title=f"{a.algo} on {task.title}" + (f" (sidecar, max_staleness {a.max_staleness})"
                                                            if a.mode == "sidecar" else ""))
    curve = held_out(run / "metrics.jsonl")
    print(f"\ntrained {a.steps} steps in {time.perf_counter() - t0:.0f}s")
    print(f"  TensorBoard logs : {run / 'tensorboard'}   (tensorboard --logdir {run / 'tensorboard'})")
    print(f"  metrics          : {run / 'metrics.jsonl'}")
    print(f"  checkpoint       : {run / 'checkpoints'}")
    print(f"  exported model   : {run / 'export'}")
    print(f"  plot             : {png}")
    if a.task == "tools":
        rate = held_out(run / "metrics.jsonl", "val/rollout/tool_call_rate")
        print(f"held-out tool-call rate: {rate[0][1]:.2f} -> {rate[-1][1]:.2f}")
    print(f"held-out reward: {curve[0][1]:.2f} -> {curve[-1][1]:.2f}")
    return 0


@contextmanager
def _etcd(run: Path, wanted: bool) -> Iterator:
    """A private etcd for sidecar mode (its data under the run's folder), stopped at the end; None otherwise."""
    if not wanted:
        yield None
        return
    from hybrid_rl.sidecar.etcd_server import EtcdProcess

    run.mkdir(parents=True, exist_ok=True)
    etcd = EtcdProcess(run / "etcd")
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.stop()


if __name__ == "__main__":
    sys.exit(main())
