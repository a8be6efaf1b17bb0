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


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    for i, a in enumerate(argv):
        if a in ("-h", "--help"):  # `--help` lists the groups, `--help GROUP` every field of one
            from hybrid_rl.config_doc import help_text

            print(help_text(argv[i + 1] if i + 1 < len(argv) else None))
            raise SystemExit(0)
    from hybrid_rl.config import split_command_line

    return split_command_line(argv)


def main(argv: list[str] | None = None) -> int:
    from hybrid_rl.checkpoint.run_lock import hold_run_lock
    from hybrid_rl.config import load_config
    from hybrid_rl.errors import HybridRLError

    setup_logging()
    try:
        name, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load_config(name, overrides)
    except HybridRLError as e:  # a function of the command line alone: every rank has the same error
        return _say_once(e, raised_by="every rank")
    try:
        with hold_run_lock(cfg.trainer.output_dir, rank=int(os.environ.get("RANK", 0)),
                           local_rank=int(os.environ.get("LOCAL_RANK", 0))):
            return _run(cfg)
    except HybridRLError as e:  # RunLocked: the holders of a lock (rank 0, each node's first rank) say so
        return _say_once(e, raised_by="this rank")


def _run(cfg) -> int:
    """Check, build and train, holding the output folder."""
    from hybrid_rl.build import build, check_inputs
    from hybrid_rl.checkpoint.compat import check_resume
    from hybrid_rl.config import resolved_yaml, to_dict
    from hybrid_rl.errors import HybridRLError, InputError

    try:
        check_inputs(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        if int(os.environ.get("RANK", 0)) == 0:  # the resolved config beside the metrics, from the start
            (Path(cfg.trainer.output_dir) / "config.yaml").write_text(resolved_yaml(cfg))
        if cfg.trainer.resume != "never":
            _say_changed(check_resume(Path(cfg.trainer.output_dir) / "checkpoints", to_dict(cfg),
                                      rank=int(os.environ.get("RANK", 0))))
        components = build(cfg)
    except (HybridRLError, ValueError) as e:  # a layout error is a ValueError too
        return _say_once(e if isinstance(e, HybridRLError) else InputError(str(e)), raised_by="every node")
    from hybrid_rl.trainer import Trainer

    trainer = Trainer(components)
    try:
        trainer.fit()
    except HybridRLError as e:  # IncompatibleCheckpoint (shapes, found at load time) and UnsafeCheckpointError too
        return _say_once(e, raised_by="this rank")
    finally:
        trainer.close()
        _shutdown()
    return 0


def _say_once(e, *, raised_by: str) -> int:
    """Print `error: ...` once and return its exit code. An error every rank raised alike (a bad command line, or one
    the ranks agreed on: `agreed`) is said by rank 0; inputs read before the ranks meet may differ between nodes (a
    file missing on one of them), so those are said by each node's first rank; any other error by the rank that
    raised it."""
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if raised_by == "every rank" or getattr(e, "agreed", False):
        say = rank == 0
    elif raised_by == "every node":
        say = local == 0
    else:
        say = True
    if say:
        print(f"error: {e}", file=sys.stderr, flush=True)
    return e.exit_code


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
