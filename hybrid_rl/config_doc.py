"""The configuration described from its own definitions: `python -m hybrid_rl.train --help [GROUP]` and the
generated reference, `docs/reference.md` (`python -m hybrid_rl.config_doc > docs/reference.md`).

Everything comes from `config.py`: each field's type and default from its dataclass, its allowed values from its
`Literal` type or from the registry that lists the choices (`config.REGISTRY_CHOICES`), and its one-line doc from the
comment on its line (or the comment lines right above it). Adding a field or a choice therefore touches one place,
and validation, `--help` and the docs agree.
"""

from __future__ import annotations

import inspect
import io
import sys
import tokenize
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass

from hybrid_rl import config as C


@dataclass(frozen=True)
class FieldDoc:
    key: str  # dotted: rollout.multi_turn.max_turns
    kind: str  # the type as written: int, str, list[str], float | None, ...
    default: str
    choices: tuple[str, ...]  # () when any value of the type goes
    doc: str


def _comments(cls: type) -> dict[str, str]:
    """Field name -> its comment: the one on its line, else the comment lines right above it."""
    src = inspect.getsource(cls)
    docs: dict[str, str] = {}
    above: list[str] = []
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    line_start_name: str | None = None
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if line_start_name is not None:
                docs[line_start_name] = " ".join([*above, text]).strip() if not docs.get(line_start_name) else text
                above = []
            else:
                above.append(text)
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and line_start_name is None:
            line_start_name = tok.string
        elif tok.type in (tokenize.NEWLINE, tokenize.NL):
            if line_start_name is not None:
                if above and line_start_name not in docs:
                    docs[line_start_name] = " ".join(above)
                above = []
            line_start_name = None
    return docs


def _kind(t: typing.Any) -> str:
    if typing.get_origin(t) is typing.Literal:
        return "str"
    if isinstance(t, type):
        return t.__name__
    return str(t).replace("typing.", "")


def _default(f) -> str:
    if f.default is not MISSING:
        v = f.default
    elif f.default_factory is not MISSING:
        v = f.default_factory()
    else:
        return "(required)"
    if is_dataclass(v):
        return ""
    if v == "???":
        return "(required)"
    return repr(v) if isinstance(v, str) else str(v).replace("True", "true").replace("False", "false").replace(
        "None", "null")


def describe(cls: type = C.Config, prefix: str = "") -> list[FieldDoc]:
    """Every leaf field of `cls`, depth first, in the order of the dataclasses."""
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = _comments(cls)
    out: list[FieldDoc] = []
    for f in fields(cls):
        t = hints[f.name]
        key = f"{prefix}{f.name}"
        if is_dataclass(t):
            out.extend(describe(t, key + "."))
            continue
        out.append(FieldDoc(key, _kind(t), _default(f), C.allowed_values(key), docs.get(f.name, "")))
    return out


def groups() -> list[str]:
    return [f.name for f in fields(C.Config) if is_dataclass(typing.get_type_hints(C.Config)[f.name])]


def help_text(group: str | None = None) -> str:
    if group is None:
        lines = ["usage: torchrun --nproc_per_node=N -m hybrid_rl.train --config-name=<recipe> [key=value ...]",
                 "       python -m hybrid_rl.train --help GROUP     every field of GROUP", "",
                 "recipes: " + ", ".join(sorted(p.stem for p in C.RECIPES_DIR.glob("*.yaml"))), "", "groups:"]
        for g in groups():
            n = sum(1 for d in describe() if d.key.startswith(g + "."))
            lines.append(f"  {g:<10} {n} fields")
        return "\n".join(lines)
    if group not in groups():
        raise C.ConfigError(f"--help {group}: no such group; groups: {', '.join(groups())}")
    lines = []
    for d in describe():
        if not d.key.startswith(group + "."):
            continue
        head = f"{d.key} ({d.kind}, default {d.default})"
        lines.append(head)
        if d.choices:
            lines.append(f"    one of: {', '.join(d.choices)}")
        if d.doc:
            lines.append(f"    {d.doc}")
    return "\n".join(lines)


def reference_markdown() -> str:
    out = ["# Configuration reference", "",
           "Generated from `hybrid_rl/config.py` by `python -m hybrid_rl.config_doc > docs/reference.md`; a test fails "
           "when it is out of date. How composition and overrides work: [configuration](configuration.md).", ""]
    for g in groups():
        out += [f"## `{g}`", "", "| key | type | default | allowed | doc |", "|---|---|---|---|---|"]
        for d in describe():
            if d.key.startswith(g + "."):
                allowed = ", ".join(f"`{c}`" for c in d.choices)
                doc = d.doc.replace("|", "\\|")
                default = d.default.replace("|", "\\|")
                out.append(f"| `{d.key}` | {d.kind.replace('|', 'or')} | `{default}` | {allowed} | {doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
