"""Run several recipes (or runs) in one torchrun launch, each a full build -> fit -> close.

Argument: a JSON list of {"name": str, "recipe": str, "overrides": [...]} runs. Starting torch, vLLM
and the process group once for all of them keeps the suite fast; each run still builds its own
models, engine, reward pool, checkpoints and metrics, exactly as `hybrid_rl.train` does. A run may
name a "probe" (`pkg.module:function`), called with its trainer before it fits: it may record what
the trainer sees (e.g. the rows it trains) for the test to check.
"""

import json
import sys
import traceback

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch.distributed as dist  # noqa: E402

from hybrid_rl.build import build  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.rollout.tools.spec import load_object  # noqa: E402
from hybrid_rl.train import setup_logging  # noqa: E402
from hybrid_rl.trainer import Trainer  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/../../engine/workers")
from common import write_result  # noqa: E402

setup_logging()
runs = json.loads(sys.argv[1])
result = {}
for run in runs:
    try:
        cfg = load_config(run["recipe"], run["overrides"])
        trainer = Trainer(build(cfg))
        if run.get("probe"):
            load_object(run["probe"], "probe")(trainer)
        try:
            trainer.fit()
        finally:
            trainer.close()
        result[run["name"]] = {"ok": True, "output_dir": cfg.trainer.output_dir,
                               "offloaded": dict(trainer.c.offload.moved_bytes)}  # rank 0's bytes per component
    except Exception as e:  # report and go on: one broken recipe must not hide the others
        traceback.print_exc()
        result[run["name"]] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        break  # the process group may be out of step after a failure on one rank
write_result(result)
dist.destroy_process_group()
