"""Tools in the loop: trajectories per second with the python tool vs without, and the step's share spent on tools.

    python benchmarks/tools.py [--nproc 2] [--steps 6] [--prompts 8] [--smoke]
    python benchmarks/tools.py --schedule [--nproc 2] [--steps 4] [--prompts 4]

The workload is the tools demo's (`python -m hybrid_rl.demo --task tools`: its warmed-up tiny model, task and
settings; the model and data are built once under benchmarks/.cache/tools_demo). Two GRPO runs through
`hybrid_rl.train`, the same in everything but the tools:

* `tools`: `rollout.tools=[python]`: a trajectory that writes a call gets the sandboxed program's output and a
  second turn;
* `no_tools`: no tools: one turn, the call (if any) stays text, nothing runs.

The policy is held fixed (`optim.lr=1e-12`): both runs sample the warmed-up model, which calls the tool in about 30%
of its samples (the `tool_call_rate` column), so the two runs differ by the tool loop alone. Per run, over steps >= 2
(step 1 also starts the tool workers): the median of samples / `timing/rollout_s` (trajectories per second of
rollout), samples / `timing/step_s` (per second of the whole step), `timing/tool_s` / `timing/step_s` (the share of
the step spent waiting on tools) and `rollout/tool_time_share` (of the rollout). `--smoke` uses the random base model
(no warm-up: it seldom calls the tool) for 2 steps of 2 prompts: it checks the script runs.

`--schedule`: the multi-turn schedule with a slow, heavy-tailed tool (`slow_tools.slow`: Pareto sleeps, mean 0.6 s,
capped at 6 s), called at every model turn (`slow_tools.always_slow`: the random base model, up to 4 model turns of
at most 8 tokens each, a 160-token budget). Three runs, the same in everything else: `lockstep_2` (the schedule before: every turn waits
for the longest generation and the slowest tool, 2 tool workers per rank), `lockstep_sized` (the same barrier, the
tool pool sized from the batch) and `trajectory` (no barrier: the engine driven request by request, each
trajectory's next turn added the moment its tool answers; the pool sized from the batch). Per run, over steps >= 2:
the median `timing/rollout_s` and the rollout's share waiting on tools.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from scale import train  # noqa: E402

from hybrid_rl.demo.__main__ import TASKS, demo_overrides, prepare_tools  # noqa: E402

TOOL_SETTINGS = ("rollout.tools", "rollout.multi_turn.")


def overrides(model: Path, data: Path, out: Path, a, *, tools: bool) -> list[str]:
    settings = {k: v for k, v in TASKS["tools"].settings.items() if tools or not k.startswith(TOOL_SETTINGS)}
    settings.update({"data.val_files": "[]", "optim.lr": "1e-12", "trainer.show_progress": "false",
                     "trainer.export": "false"})
    return demo_overrides(model=model, data=data, out=out, steps=a.steps, prompts=a.prompts, val_every=a.steps + 1,
                          extra=settings)


def run(name: str, model: Path, data: Path, a) -> dict:
    out = common.CACHE / "tools" / name
    r = train(f"tools_{name}", overrides(model, data, out, a, tools=name == "tools"), a.nproc, out)
    if not r["ok"]:
        raise RuntimeError(f"the {name} run failed (exit {r['exit']}); see {r['log']}")
    later = [s for s in r["steps"] if s["step"] >= 2]
    samples = a.prompts * 8  # rollout.n=8 (the demo's)
    return {"name": name, "log": r["log"], "steps": len(later),
            "traj_per_rollout_s": common.median([samples / s["timing/rollout_s"] for s in later]),
            "traj_per_step_s": common.median([samples / s["timing/step_s"] for s in later]),
            "step_s": common.median([s["timing/step_s"] for s in later]),
            "tool_share_of_step": common.median([s.get("timing/tool_s", 0.0) / s["timing/step_s"] for s in later]),
            "tool_share_of_rollout": common.median([s.get("rollout/tool_time_share", 0.0) for s in later]),
            # without tools nothing counts the calls the model writes (they stay text): "-" in the table
            "tool_call_rate": common.median([s.get("rollout/tool_call_rate", 0.0) for s in later]) if name == "tools"
            else None,
            "response_len": common.median([s.get("response/length_mean", 0.0) for s in later])}


SCHEDULES = {"lockstep_2": {"rollout.multi_turn.schedule": "lockstep", "rollout.multi_turn.tool_workers": 2},
             "lockstep_sized": {"rollout.multi_turn.schedule": "lockstep", "rollout.multi_turn.tool_workers": 0},
             "trajectory": {"rollout.multi_turn.schedule": "trajectory", "rollout.multi_turn.tool_workers": 0}}


def run_schedule(name: str, model: Path, data: Path, a) -> dict:
    out = common.CACHE / "tools_schedule" / name
    settings = {"rollout.tools": "[benchmarks.slow_tools:slow]", "rollout.multi_turn.parser":
                "benchmarks.slow_tools:always_slow", "rollout.max_new_tokens": 160, "rollout.multi_turn.max_turns": 4,
                "rollout.multi_turn.max_tool_calls": 4, "rollout.multi_turn.max_turn_tokens": 8,
                "rollout.multi_turn.tool_timeout_s": 10, "trainer.micro_batch_tokens": 2048, "data.val_files": "[]",
                "optim.lr": "1e-12",
                "trainer.show_progress": "false", "trainer.export": "false", **SCHEDULES[name]}
    overrides = demo_overrides(model=model, data=data, out=out, steps=a.steps, prompts=a.prompts, val_every=0,
                               extra=settings)
    r = train(f"tools_schedule_{name}", overrides, a.nproc, out)
    if not r["ok"]:
        raise RuntimeError(f"the {name} run failed (exit {r['exit']}); see {r['log']}")
    later = [s for s in r["steps"] if s["step"] >= 2]
    return {"name": name, "log": r["log"], "steps": len(later),
            "rollout_s": common.median([s["timing/rollout_s"] for s in later]),
            "tool_share_of_rollout": common.median([s.get("rollout/tool_time_share", 0.0) for s in later]),
            "turns": common.median([s.get("rollout/turns_mean", 0.0) for s in later]),
            "tool_calls": common.median([s.get("rollout/tool_calls_mean", 0.0) for s in later])}


def schedules(a) -> None:
    model, data = _base_only(common.CACHE / "tools_demo")
    rows = [run_schedule(name, model, data, a) for name in SCHEDULES]
    print(common.table(rows, [("name", "schedule", "s"), ("rollout_s", "rollout s", ".2f"),
                              ("tool_share_of_rollout", "waiting on tools", ".3f"), ("turns", "turns", ".2f"),
                              ("tool_calls", "tool calls", ".2f")]))
    before, sized, after = rows
    print(f"  rollout time, trajectory / lockstep with 2 workers: {after['rollout_s'] / before['rollout_s']:.3f}; "
          f"/ lockstep with the sized pool: {after['rollout_s'] / sized['rollout_s']:.3f}")
    common.write_result("tools_schedule", {
        "runs": rows, "nproc": a.nproc, "prompts": a.prompts, "steps": a.steps,
        "headline": [{"what": "rollout s, trajectory / lockstep (2 workers)", "value": after["rollout_s"] /
                      before["rollout_s"]},
                     {"what": "rollout s, trajectory / lockstep (sized pool)", "value": after["rollout_s"] /
                      sized["rollout_s"]}]}, quick=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (8 samples each)")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP + " (the random base model, 2 steps)")
    p.add_argument("--schedule", action="store_true", help="lockstep vs per-trajectory schedule, slow heavy-tailed tool")
    a = p.parse_args()
    if a.schedule:
        return schedules(a)
    root = common.CACHE / "tools_demo"
    if a.smoke:
        a.steps, a.prompts = 2, 2
        model, data = _base_only(root)
    else:
        model, data = prepare_tools(root)
    rows = [run(name, model, data, a) for name in ("tools", "no_tools")]
    print(common.table(rows, [("name", "run", "s"), ("traj_per_rollout_s", "traj/s (rollout)", ".2f"),
                              ("traj_per_step_s", "traj/s (step)", ".2f"), ("step_s", "step s", ".2f"),
                              ("tool_share_of_step", "tool share of step", ".3f"),
                              ("tool_share_of_rollout", "of rollout", ".3f"),
                              ("tool_call_rate", "tool-call rate", ".2f"), ("response_len", "response len", ".1f")]))
    tools, plain = rows
    ratio = tools["traj_per_step_s"] / plain["traj_per_step_s"]
    print(f"  trajectories per second of step, tools / no tools: {ratio:.3f}; "
          f"the step waits on tools {tools['tool_share_of_step']:.1%} of its time")
    common.write_result("tools", {"runs": rows, "nproc": a.nproc, "prompts": a.prompts, "steps": a.steps,
                                  "headline": [{"what": "traj/s of step, tools / no tools", "value": ratio},
                                               {"what": "share of the step waiting on tools",
                                                "value": tools["tool_share_of_step"]}]}, quick=False)


def _base_only(root: Path) -> tuple[Path, Path]:
    """The tools task's data and the random base model (no warm-up): what --smoke runs on."""
    from hybrid_rl.demo.__main__ import base_model
    from hybrid_rl.demo.tools_task import write_tools_task

    data = root / "tools_data"
    if not (data / "val.jsonl").exists():
        write_tools_task(data, n_train=2048, n_val=64)
    return base_model(root, print), data


if __name__ == "__main__":
    main()
