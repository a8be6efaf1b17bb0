"""Tool-call parsers and tools for the end-to-end tool runs (plugged in by import path)."""

from hybrid_rl.rollout.tool_calls import ToolCall


def always_python(text: str) -> list[ToolCall]:
    """Every turn calls the python tool (a random model never writes a call): the loop then runs for real."""
    return [ToolCall("python", {"code": f"print({len(text)} * 7)"})]


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: The key.
    """
    return f"value of {key}"
