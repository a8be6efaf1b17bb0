"""The demo in sidecar mode at several staleness bounds, shortened, in one launch (one vLLM server for all).

Argument: JSON {"overrides": [...], "staleness": [0, 1, 2], "steps": S, "check_every": C, "stop_at": D}. The
untrained (warmed-up) state is checkpointed once; for each bound k a fresh trainer resumes that checkpoint with
`rollout.max_staleness=k` (the requests of the previous one drained first) and trains at most S steps: every C
steps the held-out reward (greedy, the demo's held-out prompts) is measured, and the run stops once it is D above
the reward before training (measured once: every run starts from the same weights). Rank 0 writes {"before",
"after": {k: reward}, "steps": {k: steps trained}, "metrics": {k: last step's metrics}, "seconds": {k: s},
"correction": {k: the rollout correction used}}.
"""

import json
import sys
import time
from pathlib import Path

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch.distributed as dist  # noqa: E402

from hybrid_rl.build import build, trainer_settings  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.distributed.collectives import barrier, broadcast_object  # noqa: E402
from hybrid_rl.train import setup_logging  # noqa: E402
from hybrid_rl.trainer import Trainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.engine.workers.common import write_result  # noqa: E402


def main() -> None:
    setup_logging()
    args = json.loads(sys.argv[1])
    cfg = load_config("grpo", args["overrides"])
    c = build(cfg)
    cfg.trainer.resume = "auto"  # the demo's settings say never: here every bound must start from the checkpoint
    c.settings = trainer_settings(cfg, world=c.dims.world)
    first = Trainer(c)
    result = {"after": {}, "metrics": {}, "seconds": {}, "correction": {}, "steps": {}}
    try:
        first.save(0)
        result["before"] = broadcast_object(first._validate(0))
        for k in args["staleness"]:
            cfg.rollout.max_staleness = k
            c.settings = trainer_settings(cfg, world=c.dims.world)
            trainer = Trainer(c)
            assert trainer._resume() == 0
            t0 = time.perf_counter()
            for step in range(1, args["steps"] + 1):
                metrics = trainer.step(step)
                # Stop once the held-out reward has clearly risen (rank 0's verdict, so every rank stops together):
                # the test's claim is a rise within `steps`, and most bounds get there in half of them.
                if step % args["check_every"] == 0 or step == args["steps"]:
                    after = broadcast_object(trainer._validate(step))
                    if after - result["before"] >= args["stop_at"]:
                        break
            result["after"][str(k)] = after
            result["steps"][str(k)] = step
            result["metrics"][str(k)] = metrics
            result["seconds"][str(k)] = time.perf_counter() - t0
            result["correction"][str(k)] = trainer.correction.mode
            while c.rollout.in_flight():  # the next run starts from an empty buffer
                time.sleep(0.05)
            c.rollout.arrivals()
            barrier()
    finally:
        first.close()
    write_result(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
