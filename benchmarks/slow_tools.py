"""A slow, heavy-tailed tool for `benchmarks/tools.py --schedule` (plugged in by import path).

`slow` sleeps a Pareto-distributed time (shape `ALPHA`, minimum `SCALE_S`, capped at `CAP_S`: most calls are short,
a few are many times longer, as sandboxed code runs, web fetches and test suites are), drawn from its argument, so
it is reproducible. `always_slow` is a tool-call parser that makes every model turn call it (the benchmark's random
model never writes a call), so every trajectory alternates model turns and slow tool calls.
"""

from __future__ import annotations

import hashlib
import random
import time

from hybrid_rl.rollout.tool_calls import ToolCall

ALPHA = 1.5  # Pareto shape: mean SCALE_S * ALPHA / (ALPHA - 1) = 3 x SCALE_S, infinite variance
SCALE_S = 0.2
CAP_S = 6.0  # below rollout.multi_turn.tool_timeout_s


def seconds_for(key: str) -> float:
    rng = random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
    return min(CAP_S, SCALE_S * rng.paretovariate(ALPHA))


def slow(code: str) -> str:
    """Run a slow job.

    Args:
        code: the job.
    """
    seconds = seconds_for(code)
    time.sleep(seconds)
    return f"done in {seconds:.2f}s"


def always_slow(text: str) -> list[ToolCall]:
    return [ToolCall("slow", {"code": text[-24:]})]
