"""Tool calls parsed from a model turn's text, in the chat-template family's format: one parser per family.

A parser never raises on model output: a call it cannot read (bad JSON, no name, arguments that are not an object)
comes back as a `ToolCall` with `error` set; the loop answers it with that error as the tool's message and counts
it as malformed, so the model learns the format instead of the trajectory dying.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hybrid_rl.rewards.names import import_object


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # set: the call could not be read (malformed); name may be empty
    id: str = ""  # the id the model wrote for the call, in formats that have one (Mistral's)
    # Each argument's text as written, in formats that write values as bare text (Qwen3-Coder's XML, where `5` is
    # the number or the string): `typed` reads them by the tool's schema.
    written: tuple[tuple[str, str], ...] = field(default=(), compare=False)


def typed(call: ToolCall, schemas: Sequence[dict] | None) -> ToolCall:
    """`call` with the values of a bare-text format typed by its tool's JSON schema: an argument the schema declares a
    string keeps the text written (`123` stays "123"); the others keep their JSON reading. Calls of JSON formats,
    whose values carry their types, come back as they are."""
    if not call.written or call.error:
        return call
    fn = next((s.get("function", s) for s in schemas or () if s.get("function", s).get("name") == call.name), {})
    params = fn.get("parameters", {}).get("properties", {})
    args = dict(call.arguments)
    for key, text in call.written:
        if params.get(key, {}).get("type") == "string":
            args[key] = text
    return replace(call, arguments=args)


def _from_json(text: str, args_key: str = "arguments") -> ToolCall:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at char {e.pos}): {text[:200]!r}")
    return _from_object(obj, text, args_key)


def _from_object(obj: Any, text: str, args_key: str = "arguments") -> ToolCall:
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
    return ToolCall(obj["name"], args, id=str(obj.get("id") or ""))


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def hermes(text: str) -> list[ToolCall]:
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""
    return [_from_json(m.strip()) for m in _HERMES.findall(text)]


_DECODER = json.JSONDecoder()


def llama3_json(text: str) -> list[ToolCall]:
    """Llama 3.x (JSON tool calling): the whole turn is `{"name": ..., "parameters": {...}}`, or several such objects
    separated by `;`. Each object is decoded whole (`raw_decode`), so a `;` inside a string is the string's."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    calls, at = [], 0
    while at < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, at)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at char {e.pos - at}): "
                                            f"{body[at:at + 200]!r}"))
            break
        calls.append(_from_object(obj, body[at:end], "parameters"))
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return calls


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
    return [_from_object(i, json.dumps(i)) for i in items]


_ARGS_CALL = re.compile(r"\s*([^\[\]\s]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\](.*)", re.DOTALL)


def mistral_args(text: str) -> list[ToolCall]:
    """Mistral's newer format (tokenizer v11+: Mistral Small 3.2, Magistral, Devstral): each call is
    `[TOOL_CALLS]name[ARGS]{...}`, with `[CALL_ID]id` before `[ARGS]` in v11."""
    if "[TOOL_CALLS]" not in text:
        return []
    calls = []
    for part in text.split("[TOOL_CALLS]")[1:]:
        m = _ARGS_CALL.match(part)
        if m is None:
            calls.append(ToolCall("", error=f"a tool call must be name[ARGS]{{...}}, got {part[:200]!r}"))
            continue
        name, call_id, args = m.groups()
        call = _from_object({"name": name, "arguments": args.strip()}, part)
        calls.append(ToolCall(call.name, call.arguments, call.error, call_id or ""))
    return calls


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _xml_value(text: str) -> Any:
    """A parameter's value: JSON when it reads as JSON (numbers, booleans, objects, lists), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def qwen3_coder(text: str) -> list[ToolCall]:
    """Qwen3-Coder's XML calls: `<tool_call><function=name><parameter=key>value</parameter>...</function></tool_call>`
    (values read as JSON where they are, else as text; `typed` then types them by the tool's schema)."""
    calls = []
    for block in _HERMES.findall(text):
        m = _XML_FUNCTION.search(block)
        if m is None:
            calls.append(ToolCall("", error=f"a tool call must hold <function=name>...</function>, got {block[:200]!r}"))
            continue
        written = tuple(_XML_PARAMETER.findall(m.group(2)))
        calls.append(ToolCall(m.group(1), {k: _xml_value(v) for k, v in written}, written=written))
    return calls


_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_]\w*\(")


def pythonic(text: str) -> list[ToolCall]:
    """Pythonic calls (Llama 4, Llama 3.2's pythonic template): the turn is a Python list of calls with keyword
    arguments of literal values, `[calc(a=2, b=3), lookup(key="x")]`."""
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not _PYTHONIC_START.match(body):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError as e:
        return [ToolCall("", error=f"the tool calls are not a valid Python list of calls ({e.msg}): {body[:200]!r}")]
    if not isinstance(tree, ast.List):
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            calls.append(ToolCall("", error=f"each call must be name(key=value, ...), got {ast.unparse(node)[:200]!r}"))
            continue
        try:
            calls.append(ToolCall(node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
        except ValueError:
            calls.append(ToolCall(node.func.id, error=f"the arguments of {node.func.id} must be literal values"))
    return calls


@dataclass(frozen=True)
class CallFormat:
    """A family's way of writing calls: how to read them, and the turn's text without them (what an OpenAI answer
    gives as the message's `content` beside its parsed `tool_calls`)."""

    parse: Callable[[str], list[ToolCall]]
    content: Callable[[str], str]


# rollout.multi_turn.parser (or the template family's default) -> its call format
FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat(hermes, lambda text: _HERMES.sub("", text).strip()),
    "llama3_json": CallFormat(llama3_json, lambda text: ""),  # the whole turn is the calls
    "mistral": CallFormat(mistral, lambda text: text.split("[TOOL_CALLS]", 1)[0].strip()),
    "mistral_args": CallFormat(mistral_args, lambda text: text.split("[TOOL_CALLS]", 1)[0].strip()),
    "qwen3_coder": CallFormat(qwen3_coder, lambda text: _HERMES.sub("", text).strip()),
    "pythonic": CallFormat(pythonic, lambda text: ""),  # the whole turn is the calls
}
PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {name: f.parse for name, f in FORMATS.items()}


def get_format(name: str) -> CallFormat:
    """A built-in call format by name (`TemplateFamily.parser`)."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}: expected one of {sorted(FORMATS)}")
    return FORMATS[name]


def get_parser(name: str) -> Callable[[str], list[ToolCall]]:
    """A parser by name, or a user's as `pkg.module:function` (text -> list of `ToolCall`)."""
    if name in PARSERS:
        return PARSERS[name]
    if ":" in name:
        fn = import_object(name, "rollout.multi_turn.parser")
        if callable(fn):
            return fn
    raise ValueError(f"unknown tool-call parser {name!r}: expected one of {sorted(PARSERS)} or 'pkg.module:function'")
