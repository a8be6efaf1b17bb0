"""Code-execution reward: run a response's program on stdin/stdout tests inside the sandbox.

``run`` executes the program once per test (a fresh sandbox each time, ~40 ms overhead) and
``score`` returns the fraction of tests passed. A missing sandbox level raises
``SandboxUnavailableError`` (a machine/config problem); anything the program does is a score.
A run may write twice its test's expected output plus 1 MiB to stdout, and never more than
``SandboxConfig.max_output_bytes`` (32 MiB): large correct answers pass, a flood ends as ``error``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hybrid_rl.rewards.sandbox import ExecResult, SandboxConfig, execute

__all__ = ["CodeResult", "extract_code", "run", "score"]

STATUSES = ("ok", "wrong", "error", "timeout", "memory", "blocked")
# When tests fail differently, the overall status is the most severe one, in this order.
_SEVERITY = {"blocked": 5, "memory": 4, "timeout": 3, "error": 2, "wrong": 1}
_MAX_DETAIL = 300
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}
_BLOCKED_RE = re.compile(
    r"PermissionError|Read-only file system|Operation not permitted|Network is unreachable|"
    r"Temporary failure in name resolution|Name or service not known|gaierror|ConnectionRefusedError|"
    r"No route to host|Cannot assign requested address|File too large|No space left on device|"
    r"Resource temporarily unavailable|Too many open files|can't start new thread"
)
_SIGXCPU_EXIT, _SIGKILL_EXIT = 128 + 24, 128 + 9
_OUTPUT_SLACK = 1 << 20  # stdout allowed beyond twice the expected output


@dataclass(frozen=True)
class CodeResult:
    """Outcome of ``run``: tests passed out of ``total``; ``status`` is ``ok`` exactly when all passed."""

    passed: int
    total: int
    status: str
    detail: str


def extract_code(response: str) -> str:
    """The last fenced Python (or untagged) code block; the whole text where there is none.

    >>> extract_code("Here:\\n```python\\nprint(1)\\n```\\n")
    'print(1)\\n'
    """
    text = response
    if text.count("```") % 2:  # the last block was cut off: close it
        text += "```" if text.endswith("\n") else "\n```"
    blocks = [body for tag, body in _FENCE_RE.findall(text) if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else response


def _tests(tests: Any) -> list[tuple[str, str]]:
    if isinstance(tests, str | bytes):
        tests = json.loads(tests)
    if isinstance(tests, Mapping):  # columnar form, as in APPS/TACO: {"inputs": [...], "outputs": [...]}
        inputs, outputs = tests.get("inputs", tests.get("input")), tests.get("outputs", tests.get("output"))
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    return [(str(t.get("input", "")), str(t.get("output", ""))) for t in tests]


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _output_limit(expected: str, config: SandboxConfig) -> int:
    """Bytes of stdout one test's run may write: twice the expected output + 1 MiB, within the config's bound."""
    return min(2 * len(expected.encode("utf-8", "replace")) + _OUTPUT_SLACK, config.max_output_bytes)


def _judge(result: ExecResult, expected: str, timeout_s: float, output_limit: int) -> tuple[str, str]:
    """(status, detail) of one test run; status "pass" or one of STATUSES."""
    if result.output_exceeded:
        return "error", f"output limit exceeded ({output_limit} bytes)"
    if result.timed_out or result.exit_code == _SIGXCPU_EXIT:
        return "timeout", f"time limit {timeout_s:g}s exceeded"
    last = _last_line(result.stderr_tail)
    if result.exit_code != 0:
        if "MemoryError" in result.stderr_tail:
            return "memory", last or "MemoryError"
        if result.exit_code == _SIGKILL_EXIT and not last:
            return "timeout", "killed (CPU time limit)"
        if _BLOCKED_RE.search(last):
            return "blocked", last
        return "error", last or f"exit code {result.exit_code}"
    if _lines(result.stdout) == _lines(expected):
        return "pass", ""
    return "wrong", f"expected {expected.strip()[:100]!r}, got {result.stdout.strip()[:100]!r}"


def run(
    code: str,
    tests: Sequence[Mapping[str, str]],
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    *,
    config: SandboxConfig | None = None,
) -> CodeResult:
    """Run ``code`` once per test (``{"input": stdin, "output": expected stdout}``) in the sandbox.

    A test passes when stdout equals the expected output after stripping trailing whitespace on
    each line (trailing blank lines ignored). ``timeout_s`` and ``memory_mb`` apply to each test,
    and so does the output limit (``_output_limit``).
    """
    config = config or SandboxConfig()
    try:
        cases = _tests(tests)
    except (TypeError, ValueError, AttributeError, KeyError) as err:
        return CodeResult(0, 0, "error", f"unreadable tests: {err}"[:_MAX_DETAIL])
    if not cases:
        return CodeResult(0, 0, "error", "no tests")
    if not isinstance(code, str) or not code.strip():
        return CodeResult(0, len(cases), "error", "no code")
    passed, worst, detail = 0, "", ""
    for index, (stdin, expected) in enumerate(cases):
        limit = _output_limit(expected, config)
        result = execute(code, stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                         config=replace(config, max_output_bytes=limit))  # fmt: skip
        status, message = _judge(result, expected, timeout_s, limit)
        if status == "pass":
            passed += 1
        elif not worst or _SEVERITY[status] > _SEVERITY[worst]:
            worst, detail = status, f"test {index}: {message}"[:_MAX_DETAIL]
    return CodeResult(passed, len(cases), "ok" if passed == len(cases) else worst, detail)


def score(response: str, tests: Sequence[Mapping[str, str]]) -> float:
    """``passed / total`` of ``run`` on the response's last Python code block (0.0 without tests)."""
    if not isinstance(response, str):
        return 0.0
    result = run(extract_code(response), tests)
    return result.passed / result.total if result.total else 0.0
