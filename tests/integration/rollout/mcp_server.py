"""A small stdio MCP server for the MCP tools' tests (started by them: `python mcp_server.py`)."""

import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def refuse(why: str) -> str:
    """Raise an error with the given reason."""
    raise ValueError(why)


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "woke"


if __name__ == "__main__":
    server.run()
