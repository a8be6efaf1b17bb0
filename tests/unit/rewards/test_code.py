"""``code.run`` / ``code.score`` without running a program: code extraction, the inputs refused before a run and the
isolation policy. (Programs run in the sandbox: tests/integration/rewards/test_code_sandbox.py.)"""

import logging

import pytest

from hybrid_rl.rewards import sandbox
from hybrid_rl.rewards.code import CodeResult, extract_code, run, score
from hybrid_rl.rewards.sandbox import SandboxConfig, SandboxUnavailableError

REVERSE = "print(input()[::-1])"
TESTS = [{"input": "abc\n", "output": "cba"}, {"input": "xy\n", "output": "yx\n"}, {"input": "a\n", "output": "a"}]


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        ("a\n```py\nx = 1\n```\nb\n```python\nprint(2)\n```\ntext", "print(2)\n"),
        ("```python\nprint(1)\n```\n```bash\nls\n```", "print(1)\n"),
        ("```\nprint(3)\n```", "print(3)\n"),
        ("```Python3\nprint(4)\n```", "print(4)\n"),
        ("```python\nprint(5)\n", "print(5)\n"),  # cut off before the closing fence
        ("print(6)", "print(6)"),
        ("```bash\nls\n```", "```bash\nls\n```"),  # no Python block: the whole text
    ],
)
def test_extracts_the_last_python_block(response, expected):
    assert extract_code(response) == expected


def test_no_tests_is_an_error_and_scores_zero():
    assert run(REVERSE, []) == CodeResult(0, 0, "error", "no tests")
    assert score("```python\nprint(1)\n```", []) == 0.0


def test_unreadable_tests_are_an_error():
    assert run(REVERSE, "not json").status == "error"


@pytest.mark.parametrize("code", ["", "   \n", None])
def test_empty_code_is_an_error(code):
    assert run(code, TESTS).status == "error"


def test_weaker_isolation_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(sandbox, "_probed", ("rlimits", "bwrap missing (simulated)"))
    with pytest.raises(SandboxUnavailableError, match="bwrap missing"):
        run(REVERSE, TESTS)
    with pytest.raises(SandboxUnavailableError, match="min_isolation='rlimits'"):
        sandbox.check_isolation(SandboxConfig())


def test_unknown_isolation_level_is_a_config_error():
    with pytest.raises(ValueError, match="min_isolation"):
        SandboxConfig(min_isolation="none")


def test_isolation_level_is_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_probed", None)
    monkeypatch.setattr(sandbox, "_probe", lambda: ("rlimits", "simulated"))
    with caplog.at_level(logging.INFO, logger="hybrid_rl.rewards.sandbox"):
        assert sandbox.isolation_level() == "rlimits"
        assert sandbox.isolation_level() == "rlimits"
    messages = [r.getMessage() for r in caplog.records if "isolation" in r.getMessage() or "level" in r.getMessage()]
    assert len(messages) == 1 and "rlimits" in messages[0]


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_seccomp_filter_is_a_whole_number_of_bpf_instructions(machine):
    from hybrid_rl.rewards._seccomp import build_filter

    program = build_filter(machine)
    assert program is not None and len(program) % 8 == 0 and len(program) // 8 < 4096


def test_seccomp_filter_is_skipped_on_unknown_architectures():
    from hybrid_rl.rewards._seccomp import build_filter

    assert build_filter("riscv64") is None
