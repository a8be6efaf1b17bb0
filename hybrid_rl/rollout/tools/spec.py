"""What the model may call: tools by import path, environments by class, each with its JSON schema.

A tool is a plain function with type hints and a Google-style docstring (`Args:`): transformers' `get_json_schema`
turns it into the schema the chat template shows the model, and an untyped or undocumented argument is refused at
start-up (not when the model first calls it). `rollout.tools=[my_pkg.tools:calc, python]`: `python` is the built-in
sandboxed executor (`builtin.py`); `mcp:<command or URL>` adds every tool of an MCP server (`mcp_tools.py`).

An environment (`rollout.environment=my_pkg.env:Shop`) is a class built with no arguments, one instance per
trajectory: `reset(**row)` gets the dataset row's fields and may return the prompt (a string, one user message, or
a list of messages) to use instead of the row's; its public methods (not `reset` / `reward`, not starting with `_`)
are tools; an optional `reward() -> float` is read when the trajectory ends and added to the rewards
(`env_reward` in the sample's fields, the `environment` reward).

Per-turn rewards and user turns: a tool method may return an `EnvReply` instead of a plain value, with a `reward`
for that step (kept per model turn, `turn_rewards` in the sample's fields) and a `role` ("user": the environment
answers as the user, not as a tool). An optional `respond(message: str)` is called after a model turn without tool
calls (a user simulator): its reply (a string or an `EnvReply`) is the next user message, `None` ends the dialogue.
The `environment` reward is `reward()` (0 without one) plus the sum of the per-turn rewards; a class that rewards
per turn but has no `reward()` sets `rewards_per_turn = True` so that the `environment` reward is counted.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from hybrid_rl.rewards.names import import_object


class ToolInfraError(RuntimeError):
    """Raise from a tool when its infrastructure failed (a service down), not the model's call: the trajectory is
    excluded from the group statistics and the loss, and counted in `rollout/infra_failed_rate`."""


BUILTINS = {"python": "hybrid_rl.rollout.tools.builtin:python"}
RESPOND = "respond"  # an environment's user simulator (not a tool the model sees)
_ENV_RESERVED = {"reset", "reward", RESPOND}


@dataclass(frozen=True)
class EnvReply:
    """What an environment's method may return: the message's text, a reward for this step, and who speaks."""

    content: str
    reward: float = 0.0
    role: str = "tool"  # or "user": the environment answers as the user (a dialogue task)

    def __post_init__(self):
        if self.role not in ("tool", "user"):
            raise ValueError(f"EnvReply.role must be 'tool' or 'user', got {self.role!r}")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    path: str  # "pkg.module:function": what a worker process imports and calls; or "mcp:<server>" it connects to
    schema: dict  # {"type": "function", "function": {...}}


def load_object(path: str, what: str) -> Any:
    return import_object(path, what)


def schema_of(fn, what: str) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises its own TypeErrors/ValueErrors naming the argument
        raise ValueError(f"{what}: cannot build its JSON schema ({e}); a tool needs type hints and a docstring with "
                         "an Args: section describing every argument") from e


def resolve_tools(names: list[str]) -> list[ToolSpec]:
    """`rollout.tools` -> specs, in order; a name used twice is refused."""
    from hybrid_rl.rollout.tools.mcp_tools import is_mcp, list_tools

    out = []
    for name in names:
        if is_mcp(name):
            out += list_tools(name)
            continue
        path = BUILTINS.get(name, name)
        fn = load_object(path, "rollout.tools entry")
        if not callable(fn):
            raise ValueError(f"rollout.tools entry {name!r} is a {type(fn).__name__}, not a function")
        schema = schema_of(fn, f"rollout.tools entry {name!r}")
        out.append(ToolSpec(schema["function"]["name"], path, schema))
    names_seen = [t.name for t in out]
    if len(set(names_seen)) != len(names_seen):
        raise ValueError(f"rollout.tools names a tool twice: {names_seen}")
    return out


@dataclass(frozen=True)
class Environment:
    """An environment class and the schemas of its tool methods."""

    cls: type
    methods: tuple[str, ...]
    schemas: tuple[dict, ...]
    has_reward: bool
    has_respond: bool = False  # a user simulator (`respond`)

    def new(self) -> Any:
        return self.cls()

    @property
    def handlers(self) -> tuple[str, ...]:
        """The methods the tool runner may call: the tools, and `respond`."""
        return self.methods + ((RESPOND,) if self.has_respond else ())


def load_environment(path: str) -> Environment:
    cls = load_object(path, "rollout.environment")
    if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
        raise ValueError(f"rollout.environment={path!r}: expected a class with a reset(**row) method")
    try:
        probe = cls()
    except TypeError as e:
        raise ValueError(f"rollout.environment={path!r}: the class must be built with no arguments ({e})") from e
    methods = tuple(n for n, m in inspect.getmembers(cls, inspect.isfunction)
                    if not n.startswith("_") and n not in _ENV_RESERVED)
    schemas = tuple(schema_of(getattr(probe, n), f"rollout.environment method {n!r}") for n in methods)
    rewarded = callable(getattr(cls, "reward", None)) or bool(getattr(cls, "rewards_per_turn", False))
    return Environment(cls, methods, schemas, rewarded, callable(getattr(cls, RESPOND, None)))


class EnvironmentReward:
    """The `environment` reward: the environment's `reward()` at the trajectory's end (`env_reward` in the sample's
    fields; 0 where it has none). Picklable, for the reward workers."""

    def __call__(self, completion: str, sample) -> float:
        return float(sample.get("env_reward", 0.0))
