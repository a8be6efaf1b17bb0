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


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    for i, a in enumerate(argv):
        if a in ("-h", "--help"):  # `--help` lists the groups, `--help GROUP` every field of one
            from hybrid_rl.config_doc import help_text

            print(help_text(argv[i + 1] if i + 1 < len(argv) else None))
            raise SystemExit(0)
    from hybrid_rl.config import split_command_line

    return split_command_line(argv)


def main(argv: list[str] | None = None) -> int:
    from hybrid_rl.build import build, check_inputs
    from hybrid_rl.config import load_config
    from hybrid_rl.errors import HybridRLError, InputError

    setup_logging()
    try:
        name, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load_config(name, overrides)
    except HybridRLError as e:  # a function of the command line alone: every rank has the same error
        return _say_once(e, raised_by="every rank")
    try:
        check_inputs(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        components = build(cfg)
    except (HybridRLError, ValueError) as e:  # a layout error is a ValueError too
        return _say_once(e if isinstance(e, HybridRLError) else InputError(str(e)), raised_by="every node")
    from hybrid_rl.trainer import Trainer

    trainer = Trainer(components)
    try:
        trainer.fit()
    except HybridRLError as e:
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


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
