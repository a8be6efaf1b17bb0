"""Fault injection for the fault-tolerance tests.

`HYBRID_RL_FAULT=<point>:<step>` makes every rank SIGKILL itself when it reaches `point` at `step`,
the way a node failure or an OOM killer would stop it: no handler runs, no file is closed cleanly.
Points: `checkpoint_write` (after the shards are written, before the checkpoint is committed).
Unset in normal runs; costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "HYBRID_RL_FAULT"


def maybe_die(point: str, step: int) -> None:
    if os.environ.get(ENV) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
