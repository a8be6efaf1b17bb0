"""Start-up memory: each rank's peak RSS while `build()` loads the models, against what it must hold.

    python benchmarks/startup.py [--quick] [--worlds 2 4] [--recipe grpo] [--set key=value ...]

A Qwen2.5-0.5B-shaped model (its real config: 24 layers, hidden 896, 14 heads, 2 KV heads, vocabulary
151936, tied embeddings; random weights saved in bf16 as real checkpoints are, one safetensors file)
is built once under benchmarks/.cache/models. For each world size, one torchrun launch runs
`hybrid_rl.build.build(cfg)` of the recipe (GRPO: actor + reference; vLLM starts later, at the first
weight sync, so it is not part of this peak). Each rank reads, inside itself:

* bare: its RSS after torch, transformers and the process group are up, before `build()`;
* peak: its RSS high-water mark during `build()` (VmHWM, reset just before);
* share: the bytes of its own shards of every model `build()` returned (actor, reference, ...);
* one layer: the largest decoder block, unsharded, in float32 (the planner's block size);
* the memory planner's `startup` phase for this configuration (`hybrid_rl.plan_inputs.plan_for`).

Target, per rank: peak <= bare + share + one layer, at every world size.

Writes benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import qwen_shapes  # noqa: E402

GIB = 2**30


# =================================================================================================
# Worker (under torchrun)
# =================================================================================================


def worker(recipe: str, overrides: list[str]) -> None:
    import logging

    import torch.distributed as dist
    import transformers  # noqa: F401 - part of the bare process, as in the trainer
    from transformers import AutoModelForCausalLM  # noqa: F401

    from hybrid_rl.build import build
    from hybrid_rl.config import load_config
    from hybrid_rl.distributed.fsdp import local_tensor
    from hybrid_rl.distributed.mesh import init_distributed
    from hybrid_rl.plan_inputs import plan_for
    from hybrid_rl.utils import memory

    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(recipe, overrides)
    dims = init_distributed(cfg.rollout.tp)
    plan = plan_for(cfg, dims.world)
    dist.barrier()
    bare = memory.rss_bytes()
    if not memory.reset_peak_rss():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the peak would include earlier work")
    t0 = time.perf_counter()
    c = build(cfg)
    build_s = time.perf_counter() - t0
    peak = memory.peak_rss_bytes()
    models = {n: m.module for n in ("actor", "reference", "critic", "reward_model") if (m := getattr(c, n)) is not None}
    share = {n: sum(local_tensor(p).nbytes for p in m.parameters()) for n, m in models.items()}
    startup = plan.phase("startup")
    row = {"rank": dims.rank, "bare": bare, "peak": peak, "share": share, "build_s": build_s,
           "one_layer": 4 * plan.inputs.actor.block_numel(), "plan_startup": startup.total,
           "plan_items": {f"{i.component} {i.what}": i.bytes for i in startup.items}}
    rows = [None] * dims.world
    dist.all_gather_object(rows, row)
    if dims.rank == 0:
        common.worker_write({"world": dims.world, "ranks": rows})
    dist.destroy_process_group()


# =================================================================================================
# Driver
# =================================================================================================


def overrides(model: Path, extra: list[str]) -> list[str]:
    from hybrid_rl.demo.task import write_task

    root = common.CACHE / "task"
    if not (root / "train.jsonl").exists():
        write_task(root, n_train=2048, n_val=64)
    base = {"model.path": model, "data.train_files": f"[{root / 'train.jsonl'}]", "reward.num_workers": 0,
            "trainer.output_dir": common.CACHE / "startup_out", "trainer.show_progress": "false",
            # Only build() runs here: the whole run's plan (the update's peak, 9 GiB a rank at 0.5B) must not stop it
            # on a machine other jobs share; the figure is the build's own peak.
            "trainer.memory_check": "warn"}
    return [f"{k}={v}" for k, v in base.items()] + list(extra)


def summarize(world: int, ranks: list[dict]) -> list[dict]:
    out = []
    for r in ranks:
        share = sum(r["share"].values())
        bound = r["bare"] + share + r["one_layer"]
        out.append({"world": world, "rank": r["rank"], "bare_gib": r["bare"] / GIB, "share_gib": share / GIB,
                    "one_layer_gib": r["one_layer"] / GIB, "bound_gib": bound / GIB, "peak_gib": r["peak"] / GIB,
                    "growth_gib": (r["peak"] - r["bare"]) / GIB,
                    "plan_gib": r["plan_startup"] / GIB,
                    "over_bound_gib": (r["peak"] - bound) / GIB, "build_s": r["build_s"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="same as the full run (one build per world size)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--recipe", default="grpo")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP + " (world 2, the 4M model)")
    p.add_argument("--worker", nargs=2, metavar=("RECIPE", "OVERRIDES_JSON"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], json.loads(a.worker[1]))
        return
    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    model = common.sized_model("4M") if a.smoke else qwen_shapes.folder("0.5B")
    if a.smoke:
        a.worlds = [2]
    args = overrides(model, a.set)
    rows, targets = [], []
    for world in a.worlds:
        got = common.torchrun(__file__, ["--worker", a.recipe, json.dumps(args)], nproc=world, timeout=1800,
                              tag=f"startup_w{world}")
        rows += summarize(world, got["ranks"])
        worst = max((r for r in rows if r["world"] == world), key=lambda r: r["over_bound_gib"])
        targets.append(common.check(f"world {world}: worst rank's peak - (bare + share + one layer)",
                                    worst["over_bound_gib"], 0.0, higher_is_better=False, unit=" GiB"))
    print(f"\nStart-up peak RSS per rank, {a.recipe}, {model.name} (GiB; plan = the planner's startup phase)")
    print(common.table(rows, [("world", "world", "d"), ("rank", "rank", "d"), ("bare_gib", "bare", ".2f"),
                              ("share_gib", "share", ".2f"), ("one_layer_gib", "layer", ".2f"),
                              ("bound_gib", "bound", ".2f"), ("peak_gib", "peak", ".2f"),
                              ("growth_gib", "peak-bare", ".2f"), ("plan_gib", "plan", ".2f"),
                              ("build_s", "build s", ".1f")]))
    headline = [{"what": f"world {w}: largest peak RSS (GiB)", "value": max(r["peak_gib"] for r in rows
                                                                              if r["world"] == w)}
                for w in a.worlds]
    common.write_result("startup", {"model": str(model.name), "recipe": a.recipe, "overrides": a.set, "rows": rows,
                                    "targets": targets, "headline": headline}, quick=a.quick)


if __name__ == "__main__":
    main()
