"""Worker (torchrun, one GPU): `hybrid_rl.train`'s own steps, with the eager generator in place of vLLM.

Arguments: the recipe's command line (`--config-name=grpo key=value ...`). Runs what `hybrid_rl.train.main` runs
(config, input checks, `build`, `Trainer.fit`), with `rollout.mode=colocated` built by `eager_rollout.EagerEngine`
behind the real `Sampler`. Writes the memory plan's phases (every item, bytes) and the device's peak allocation of
the whole run to $HR_TEST_OUT; the step metrics are in the run's own metrics.jsonl.
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch  # noqa: E402

from hybrid_rl import build as build_module  # noqa: E402
from hybrid_rl.build import build, check_inputs, sampling_settings  # noqa: E402
from hybrid_rl.colocated.sampler import Sampler  # noqa: E402
from hybrid_rl.config import load_config, split_command_line  # noqa: E402
from hybrid_rl.distributed.mesh import device  # noqa: E402
from hybrid_rl.trainer import Trainer  # noqa: E402
from hybrid_rl.utils.logs import setup_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from eager_rollout import EagerEngine  # noqa: E402


def eager_colocated(cfg, dims, actor, offload, tokenizer, plan):
    engine = EagerEngine(actor.module, tokenizer.pad_token_id, device())
    return Sampler(engine, tokenizer, dims, sampling_settings(cfg), seed=cfg.trainer.seed)


def main() -> None:
    setup_logging()
    colocated = build_module.DEPLOYMENTS["colocated"]
    build_module.DEPLOYMENTS["colocated"] = dataclasses.replace(colocated, build=eager_colocated)
    name, overrides = split_command_line(sys.argv[1:])
    cfg = load_config(name, overrides)
    check_inputs(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    components = build(cfg)
    assert components.actor.module.lm_head.weight.device.type == device().type
    trainer = Trainer(components)
    try:
        trainer.fit()
    finally:
        trainer.close()
    plan = components.plan
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "device_total_bytes": plan.device_bytes,
        "fits": plan.fits,
        "phases": {p.name: [[i.component, i.what, i.bytes, i.offloaded] for i in p.items] for p in plan.phases},
        "run_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
    }
    if int(os.environ.get("RANK", 0)) == 0:
        Path(os.environ["HR_TEST_OUT"]).write_text(json.dumps(result, indent=1))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
