"""`package.module:name` from a config (a reward, a tool, a tool-call parser, an environment, an agent) to the object.

A config is code: whatever it names is imported and called by the run, with the run's files and credentials. So
use configs only from people you would let run a program on your account. This resolver refuses only the obvious
misuses, names that are never a reward or a tool: the standard library's process, file, interpreter and
serialization modules (`os:system`, `subprocess:run`, `builtins:eval`, `shutil:rmtree`, ...), whether named
directly, reached through attributes (`json:codecs.sys`) or re-exported by another module (`mypkg:system` where
mypkg did `from os import system`), and private or dunder attributes.

It lives in the rewards package, the bottom layer that resolves such names (rollout's tools, parsers and agents
use it from here).
"""

from __future__ import annotations

import importlib
import types
from typing import Any

REFUSED_MODULES = frozenset({
    "os", "posix", "nt", "subprocess", "builtins", "__builtin__", "shutil", "sys", "importlib", "ctypes", "_ctypes",
    "pickle", "_pickle", "marshal", "runpy", "code", "codeop", "pty", "socket", "_socket", "multiprocessing",
    "_posixsubprocess", "signal", "_signal", "pdb", "webbrowser", "tempfile", "io", "_io", "pathlib",
})  # fmt: skip


def import_object(path: str, what: str) -> Any:
    """The object `path` ('package.module:name', `name` may be dotted) names; ValueError saying why not."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r}: expected 'package.module:name'")
    _refuse_module(module_name, path, what)
    if any(part.startswith("_") for part in attr.split(".")):
        raise ValueError(f"{what} {path!r}: refused: a private or dunder attribute ({attr!r}) is not a reward, tool "
                         "or parser")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
        owner = target.__name__ if isinstance(target, types.ModuleType) else getattr(target, "__module__", None)
        if isinstance(owner, str):
            _refuse_module(owner, path, what)
    return target


def _refuse_module(module_name: str, path: str, what: str) -> None:
    if module_name.split(".")[0] in REFUSED_MODULES:
        raise ValueError(f"{what} {path!r}: refused: it names {module_name!r}, a standard-library module that runs "
                         "processes, touches files or the interpreter, never a reward or a tool. A config is code "
                         "(everything it names runs as you): use configs only from people you trust")
