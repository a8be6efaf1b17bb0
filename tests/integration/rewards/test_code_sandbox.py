"""``code.run`` / ``code.score`` running programs in the sandbox (a process each): test verdicts, status mapping, output
limits, and a run at the weaker isolation level where the config allows it."""

import json

import pytest

from hybrid_rl.rewards import sandbox
from hybrid_rl.rewards.code import CodeResult, run, score
from hybrid_rl.rewards.sandbox import SandboxConfig
from tests.unit.rewards.test_code import REVERSE, TESTS

LARGE_N = 250_000  # 0..N-1, one a line: 1.6 MB of output, over the fixed 1 MiB cap this reward once had
FLOOD = "while True:\n    print('y' * 1000)"


def _write(n_bytes: int) -> str:
    return f"import sys\nsys.stdout.write('y' * {n_bytes})"


@pytest.mark.sandbox
def test_correct_program_passes_every_test():
    assert run(REVERSE, TESTS) == CodeResult(passed=3, total=3, status="ok", detail="")


@pytest.mark.sandbox
def test_trailing_whitespace_and_blank_lines_are_ignored():
    tests = [{"input": "", "output": "1\n2"}]
    assert run("print('1   ')\nprint('2\\t')\nprint()\nprint()", tests).status == "ok"
    assert run("print(' 1')\nprint(2)", tests).status == "wrong"  # leading whitespace counts


@pytest.mark.sandbox
def test_partly_correct_program_is_wrong_with_partial_credit():
    code = "s = input()\nprint(s[::-1] if len(s) > 1 else 'nope')"
    result = run(code, TESTS)
    assert (result.passed, result.total, result.status) == (2, 3, "wrong")
    assert "test 2" in result.detail and "nope" in result.detail


@pytest.mark.sandbox
def test_runtime_error_is_error_with_the_exception_in_the_detail():
    result = run("raise ValueError('bad input')", TESTS[:1])
    assert result.status == "error" and "ValueError: bad input" in result.detail


@pytest.mark.sandbox
def test_syntax_error_is_error():
    assert run("def f(:\n  pass", TESTS[:1]).status == "error"


@pytest.mark.sandbox
def test_program_reads_all_of_stdin():
    tests = [{"input": "\n".join(map(str, range(100_000))) + "\n", "output": str(sum(range(100_000)))}]
    assert run("import sys\nprint(sum(int(x) for x in sys.stdin))", tests).status == "ok"


@pytest.mark.sandbox
def test_main_guard_runs():
    assert (
        run(
            "def main():\n    print('a')\nif __name__ == '__main__':\n    main()", [{"input": "", "output": "a"}]
        ).passed
        == 1
    )


@pytest.mark.sandbox
def test_unicode_output_is_compared_as_text():
    assert run("print('héllo ✓')", [{"input": "", "output": "héllo ✓"}]).status == "ok"


@pytest.mark.sandbox
def test_worst_failure_decides_the_status():
    code = "import sys\nn = int(input())\nif n == 1:\n    print(1)\nelif n == 2:\n    print(0)\nelse:\n    while True: pass"
    tests = [{"input": "1", "output": "1"}, {"input": "2", "output": "2"}, {"input": "3", "output": "3"}]
    result = run(code, tests, timeout_s=1.0)
    assert (result.passed, result.status) == (1, "timeout")


@pytest.mark.sandbox
def test_tests_may_be_given_as_json_or_columns():
    columns = {"inputs": ["abc\n", "xy\n"], "outputs": ["cba", "yx"]}
    assert run(REVERSE, json.dumps(TESTS)).status == "ok"
    assert run(REVERSE, columns).status == "ok"


@pytest.mark.sandbox
def test_correct_program_with_a_large_output_passes():
    expected = "\n".join(map(str, range(LARGE_N))) + "\n"
    assert len(expected) > 1_500_000
    code = f"print('\\n'.join(map(str, range({LARGE_N}))))"
    assert run(code, [{"input": "", "output": expected}]) == CodeResult(1, 1, "ok", "")


@pytest.mark.sandbox
def test_output_may_be_twice_the_expected_plus_one_mib():
    test = {"input": "", "output": "y" * 1_500_000}
    limit = 2 * 1_500_000 + (1 << 20)
    assert run(_write(limit), [test]).status == "wrong"  # kept whole and compared
    over = run(_write(limit + 1), [test])
    assert over == CodeResult(0, 1, "error", f"test 0: output limit exceeded ({limit} bytes)")
    assert run(FLOOD, [test], timeout_s=2.0) == over


@pytest.mark.sandbox
def test_output_limit_never_passes_the_configured_bound():
    test = {"input": "", "output": "y" * 1_500_000}  # would allow 4 MiB
    config = SandboxConfig(max_output_bytes=2 << 20)
    assert run(_write(2 << 20), [test], config=config).status == "wrong"
    over = run(_write((2 << 20) + 1), [test], config=config)
    assert over.detail == f"test 0: output limit exceeded ({2 << 20} bytes)"


@pytest.mark.sandbox
def test_a_flood_stops_at_32_mib_by_default_whatever_the_test_expects():
    result = run(FLOOD, [{"input": "", "output": "y" * (20 << 20)}], timeout_s=5.0)
    assert result == CodeResult(0, 1, "error", f"test 0: output limit exceeded ({32 << 20} bytes)")


@pytest.mark.sandbox
def test_score_is_the_fraction_of_tests_passed():
    response = "Reverse it:\n```python\ns = input()\nprint(s[::-1] if len(s) > 1 else 'nope')\n```"
    assert score(response, TESTS) == pytest.approx(2 / 3)
    assert score(None, TESTS) == 0.0


def test_weaker_isolation_runs_when_the_config_allows_it(monkeypatch):
    monkeypatch.setattr(sandbox, "_probed", ("rlimits", "bwrap missing (simulated)"))
    result = run(REVERSE, TESTS, config=SandboxConfig(min_isolation="rlimits"))
    assert result.status == "ok"
    assert run("while True: pass", TESTS[:1], timeout_s=1.0, config=SandboxConfig(min_isolation="rlimits")).status == (
        "timeout"
    )
