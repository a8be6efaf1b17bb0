"""What runs inside a tool worker process: import the tool by path, call it under a time limit, bound its output.

The time limit interrupts Python code (sleeps, loops); a call stuck in C code past it is the parent's to end
(`runner.ToolRunner` kills the worker). The result is cut to `max_chars` here, so a flood never crosses the pipe.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from hybrid_rl.rewards._pool_worker import _exit_with_parent  # the reward pool's: leave when the trainer is gone
from hybrid_rl.rewards._time_limit import time_limit
from hybrid_rl.rollout.tools.spec import ToolInfraError, load_object

_functions: dict[str, Any] = {}
_limit_s = 30.0

OK, ERROR, TIMEOUT, INFRA = "ok", "error", "timeout", "infra"


_mcp: dict[str, Any] = {}  # MCP servers (`mcp_tools`), connected once per worker


def init(mcp_servers: tuple[str, ...] = ()) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    _exit_with_parent()
    if mcp_servers:
        from hybrid_rl.rollout.tools.mcp_tools import Connection

        for entry in mcp_servers:
            _mcp[entry] = Connection(entry)


def ready() -> int:
    return os.getpid()


def limit_s() -> float:
    """The time limit of the call running now (the built-in python tool fits its sandbox inside it)."""
    return _limit_s


def middle_cut(text: str, keep: int, marker: str = "\n...[{n} characters cut]...\n") -> str:
    if len(text) <= keep:
        return text
    head = keep // 2
    return text[:head] + marker.format(n=len(text) - keep) + text[len(text) - (keep - head):]


def as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)


def call(path: str, arguments: dict, timeout_s: float, max_chars: int, name: str = "") -> tuple[str, str]:
    """(status, text) of one call (`name`: the tool's, for an MCP server's); never raises for the tool's own
    failures."""
    global _limit_s
    _limit_s = timeout_s
    try:
        if path in _mcp:
            def fn(**kwargs):
                return _mcp[path].call(name, kwargs)
        else:
            fn = _functions.get(path) or _functions.setdefault(path, load_object(path, "tool"))
        with time_limit(timeout_s) as limit:
            out = fn(**arguments)
        if limit.expired:
            return TIMEOUT, f"Error: the tool timed out after {timeout_s:g}s"
        return OK, middle_cut(as_text(out), max_chars)
    except ToolInfraError as e:
        return INFRA, middle_cut(str(e), max_chars)
    except TypeError as e:  # usually arguments that do not match the signature: the model's mistake
        return ERROR, middle_cut(f"Error: {e}", max_chars)
    except Exception as e:  # noqa: BLE001 - a tool's failure is a message to the model, not the run's
        return ERROR, middle_cut(f"Error: {type(e).__name__}: {e}", max_chars)
