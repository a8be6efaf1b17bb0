"""The built-in `python` tool: the code reward's sandbox (same isolation), bounded in time and output."""

from __future__ import annotations

from hybrid_rl.rewards.sandbox import SandboxConfig, SandboxUnavailableError, execute
from hybrid_rl.rollout.tools import _worker
from hybrid_rl.rollout.tools.spec import ToolInfraError

MEMORY_MB = 512
OUTPUT_BYTES = 64 << 10  # more than any tool response kept (rollout.multi_turn.max_tool_response_tokens)


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints (stdout), or its error.

    Args:
        code: The Python source to run; print the values you need.
    """
    try:
        r = execute(code, "", timeout_s=max(0.5, _worker.limit_s() - 1.0), memory_mb=MEMORY_MB,
                    config=SandboxConfig(max_output_bytes=OUTPUT_BYTES))
    except SandboxUnavailableError as e:
        raise ToolInfraError(str(e)) from e
    if r.timed_out:
        return f"{r.stdout}\nError: the program ran out of time".strip()
    if r.output_exceeded:
        return f"{r.stdout}\n...\nError: the program printed too much".strip()
    if r.exit_code != 0:
        return f"{r.stdout}\nError (exit code {r.exit_code}):\n{r.stderr_tail}".strip()
    return r.stdout
