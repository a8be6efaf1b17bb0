"""Entry point: `torchrun --nproc_per_node=N -m hybrid_rl.train --config-name=<recipe> key=value ...`.

Exit codes: 0 done (or stopped by SIGTERM/Ctrl-C after a checkpoint), 2 bad configuration or input
(one message naming the key, file or line), 1 anything else.
"""

from __future__ import annotations

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import os  # noqa: E402
import sys  # noqa: E402

from hybrid_rl.utils.logs import setup_logging  # noqa: E402 - also imported from here by the test workers

EXIT_BAD_INPUT = 2


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        raise SystemExit(0)
    from hybrid_rl.config import split_command_line

    return split_command_line(argv)


def main(argv: list[str] | None = None) -> int:
    from hybrid_rl.build import build, check_inputs
    from hybrid_rl.config import ConfigError, load_config

    setup_logging()
    try:
        name, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load_config(name, overrides)
        check_inputs(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        components = build(cfg)
    except (ConfigError, ValueError) as e:  # DatasetError and the engine's layout errors are ValueErrors too
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    from hybrid_rl.rollout.base import RolloutError
    from hybrid_rl.trainer import Trainer, TrainingError
    from hybrid_rl.weightsync.reshard import WeightSyncError

    trainer = Trainer(components)
    try:
        trainer.fit()
    except (TrainingError, RolloutError, WeightSyncError) as e:
        # An error every rank agreed on (the same verdict everywhere) is said once, by rank 0.
        if not getattr(e, "agreed", False) or int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        trainer.close()
        _shutdown()
    return 0


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
