"""Tools from MCP servers: `rollout.tools=[mcp:<command or URL>]` lists the server's tools and calls them.

`mcp:python -m my_pkg.server` starts the command and speaks MCP over its stdin/stdout; `mcp:http://host:port/mcp`
connects to a Streamable HTTP server. At start-up the server is asked for its tools (`list_tools`): each becomes a
tool of the run under its own name, with the input schema the server gives as the chat template's `parameters`.

Calls run in the tool runner's worker processes like any Python tool, with the same bounds and failure accounting:
each worker connects to each server once, when it starts (a stdio server is the worker's child, and ends with it,
its stdin closed), and calls it from there under the worker's time limit. A call the server answers as an error is
the model's (`Error: ...` back to it); a connection that fails is an infrastructure failure (`ToolInfraError`).
"""

from __future__ import annotations

import asyncio
import shlex
import threading
from typing import Any

from hybrid_rl.rollout.tools.spec import ToolInfraError, ToolSpec

PREFIX = "mcp:"
CONNECT_TIMEOUT_S = 120.0


def is_mcp(entry: str) -> bool:
    return entry.startswith(PREFIX)


def _target(entry: str) -> Any:
    """What `mcp.Client` connects to: a URL, or the command to start as a stdio server."""
    from mcp.client.stdio import StdioServerParameters

    server = entry[len(PREFIX):].strip()
    if server.startswith(("http://", "https://")):
        return server
    argv = shlex.split(server)
    if not argv:
        raise ValueError(f"rollout.tools entry {entry!r}: expected mcp:<command> or mcp:<URL>")
    return StdioServerParameters(command=argv[0], args=argv[1:])


def list_tools(entry: str, timeout_s: float = CONNECT_TIMEOUT_S) -> list[ToolSpec]:
    """The server's tools as specs (each with `path` = the entry, which a worker connects to)."""
    from mcp import Client

    async def listing():
        async with Client(_target(entry)) as client:
            return (await client.list_tools()).tools

    try:
        tools = asyncio.run(asyncio.wait_for(listing(), timeout_s))
    except Exception as e:  # noqa: BLE001 - a server that cannot start or answer: say which, at start-up
        raise ValueError(f"rollout.tools entry {entry!r}: cannot list the MCP server's tools "
                         f"({type(e).__name__}: {e})") from e
    if not tools:
        raise ValueError(f"rollout.tools entry {entry!r}: the MCP server offers no tools")
    return [ToolSpec(t.name, entry, {"type": "function", "function": {
        "name": t.name, "description": t.description or "",
        "parameters": getattr(t, "input_schema", None) or getattr(t, "inputSchema", None) or {"type": "object"}}})
        for t in tools]


class Connection:
    """One MCP server, connected for the life of this process: an event loop in a daemon thread holds the client
    (its context entered and left in one task, as anyio requires); calls are submitted to it and waited on."""

    def __init__(self, entry: str, timeout_s: float = CONNECT_TIMEOUT_S):
        from mcp import Client

        self.entry, self._client, self._ready = entry, None, threading.Event()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True, name="mcp-client").start()

        async def hold():
            async with Client(_target(entry)) as client:
                self._client = client
                self._ready.set()
                await asyncio.Event().wait()  # until the process ends

        self._held = asyncio.run_coroutine_threadsafe(hold(), self._loop)
        if not self._ready.wait(timeout_s) or self._held.done():
            error = self._held.exception() if self._held.done() else TimeoutError(f"no answer in {timeout_s:g}s")
            raise ToolInfraError(f"cannot connect to the MCP server {entry!r}: {type(error).__name__}: {error}")

    def call(self, name: str, arguments: dict) -> str:
        if self._held.done():
            raise ToolInfraError(f"the connection to the MCP server {self.entry!r} is gone")
        try:
            result = asyncio.run_coroutine_threadsafe(self._client.call_tool(name, arguments), self._loop).result()
        except Exception as e:  # noqa: BLE001 - transport or protocol failure: not the model's call
            raise ToolInfraError(f"the MCP server {self.entry!r} failed: {type(e).__name__}: {e}") from e
        text = "\n".join(c.text for c in result.content if getattr(c, "text", None) is not None)
        if result.is_error:
            raise MCPToolError(text or "the MCP tool failed")
        return text


class MCPToolError(Exception):
    """The server answered the call as an error: the model reads its text."""
