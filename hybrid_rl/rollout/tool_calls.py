"""Tool calls parsed from a model turn's text, in the chat-template family's format: one parser per family.

A parser never raises on model output: a call it cannot read (bad JSON, no name, arguments that are not an object)
comes back as a `ToolCall` with `error` set; the loop answers it with that error as the tool's message and counts
it as malformed, so the model learns the format instead of the trajectory dying.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybrid_rl.rewards.names import import_object


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # set: the call could not be read (malformed); name may be empty


def _from_json(text: str, args_key: str = "arguments") -> ToolCall:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at char {e.pos}): {text[:200]!r}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", error='a tool call must be a JSON object with a "name" string, got ' + repr(text[:200]))
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f'the "{args_key}" of a tool call must be a JSON object, got {args!r:.200}')
    return ToolCall(obj["name"], args)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def hermes(text: str) -> list[ToolCall]:
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""
    return [_from_json(m.strip()) for m in _HERMES.findall(text)]


def llama3_json(text: str) -> list[ToolCall]:
    """Llama 3.x (JSON tool calling): the whole turn is `{"name": ..., "parameters": {...}}` (or several, `;`-separated)."""
    body = text.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    return [_from_json(part.strip(), "parameters") for part in body.split(";") if part.strip()]


def mistral(text: str) -> list[ToolCall]:
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""
    if "[TOOL_CALLS]" not in text:
        return []
    body = text.split("[TOOL_CALLS]", 1)[1].strip()
    try:
        items = json.loads(body)
    except json.JSONDecodeError as e:
        return [ToolCall("", error=f"the tool calls are not a valid JSON list ({e.msg}): {body[:200]!r}")]
    if not isinstance(items, list):
        items = [items]
    return [_from_json(json.dumps(i)) for i in items]


# rollout.multi_turn.parser (or the template family's default) -> parser
PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": hermes, "llama3_json": llama3_json,
                                                        "mistral": mistral}


def get_parser(name: str) -> Callable[[str], list[ToolCall]]:
    """A parser by name, or a user's as `pkg.module:function` (text -> list of `ToolCall`)."""
    if name in PARSERS:
        return PARSERS[name]
    if ":" in name:
        fn = import_object(name, "rollout.multi_turn.parser")
        if callable(fn):
            return fn
    raise ValueError(f"unknown tool-call parser {name!r}: expected one of {sorted(PARSERS)} or 'pkg.module:function'")
