"""Tools in the loop: trajectories per second with the python tool vs without, and the step's share spent on tools.

    python benchmarks/tools.py [--nproc 2] [--steps 6] [--prompts 8] [--smoke]

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (8 samples each)")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP + " (the random base model, 2 steps)")
    a = p.parse_args()
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
