"""Entry point: `torchrun --nproc_per_node=N -m hybrid_rl.train --config-name=<recipe> key=value ...`.

Exit codes: 0 done (or stopped by SIGTERM/Ctrl-C after a checkpoint), 2 bad configuration or input
(one message naming the key, file or line; another run holding `trainer.output_dir`; a checkpoint there of another
model or algorithm, or one with files that are not plain data), 1 anything else.

The run holds its output folder for its whole life (`checkpoint/run_lock.py`) and writes everything there
private to its user (umask 077).
"""

from __future__ import annotations

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import logging  # noqa: E402
import os  # noqa: E402

# Before anything is written: checkpoints, logs, rollout dumps and the run's secret are its user's alone on a
# shared node (processes the run starts inherit it).
os.umask(0o077)
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from hybrid_rl.utils.logs import setup_logging  # noqa: E402 - also imported from here by the test workers

EXIT_BAD_INPUT = 2


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        raise SystemExit(0)
    from hybrid_rl.config import split_command_line

    return split_command_line(argv)


def main(argv: list[str] | None = None) -> int:
    from hybrid_rl.config import ConfigError, load_config

    setup_logging()
    try:
        name, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load_config(name, overrides)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    from hybrid_rl.checkpoint.run_lock import RunLocked, hold_run_lock

    try:
        with hold_run_lock(cfg.trainer.output_dir, rank=int(os.environ.get("RANK", 0)),
                           local_rank=int(os.environ.get("LOCAL_RANK", 0))):
            return _run(cfg)
    except RunLocked as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


def _run(cfg) -> int:
    """Build and train, holding the output folder."""
    from hybrid_rl.build import build, check_inputs
    from hybrid_rl.checkpoint.compat import IncompatibleCheckpoint, check_resume
    from hybrid_rl.checkpoint.untrusted import UnsafeCheckpointError
    from hybrid_rl.config import ConfigError, to_dict

    refused = (IncompatibleCheckpoint, UnsafeCheckpointError)  # another run's or someone else's checkpoint
    try:
        check_inputs(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        if cfg.trainer.resume != "never":
            _say_changed(check_resume(Path(cfg.trainer.output_dir) / "checkpoints", to_dict(cfg),
                                      rank=int(os.environ.get("RANK", 0))))
        components = build(cfg)
    except (ConfigError, ValueError, *refused) as e:  # DatasetError and the engine's layout errors are ValueErrors
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    from hybrid_rl.rollout.base import RolloutError
    from hybrid_rl.trainer import Trainer, TrainingError
    from hybrid_rl.weightsync.reshard import WeightSyncError

    trainer = Trainer(components)
    try:
        trainer.fit()
    except refused as e:  # found only at load time (a model of other shapes at the same path): agreed by all ranks
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except (TrainingError, RolloutError, WeightSyncError) as e:
        # An error every rank agreed on (the same verdict everywhere) is said once, by rank 0.
        if not getattr(e, "agreed", False) or int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        trainer.close()
        _shutdown()
    return 0


def _say_changed(changed: list[str]) -> None:
    if changed and int(os.environ.get("RANK", 0)) == 0:
        logging.getLogger(__name__).warning("resuming with settings that differ from the checkpoint's: %s",
                                            "; ".join(changed))


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
