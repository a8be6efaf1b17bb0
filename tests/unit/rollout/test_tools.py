"""The tool API and the tool runner: schemas from typed functions, environments, the sandboxed python tool, and
calls that are malformed, hang, crash or flood, each bounded and costing that call only."""

import time

import pytest

from hybrid_rl.rollout.multi_turn import TRUNCATION_MARKER, ToolLoop, TurnLimits
from hybrid_rl.rollout.tool_calls import ToolCall, hermes, llama3_json, mistral
from hybrid_rl.rollout.tools import ToolRequest, ToolRunner, load_environment, resolve_tools
from tests.unit.rollout.templates import tokenizer_for

M = "tests.unit.rollout.tool_fns"


def test_a_typed_documented_function_is_a_tool_with_its_json_schema():
    specs = resolve_tools([f"{M}:echo", "python"])
    assert [s.name for s in specs] == ["echo", "python"]
    fn = specs[0].schema["function"]
    assert fn["description"] == "Return the text." and fn["parameters"]["properties"]["text"]["type"] == "string"
    assert specs[1].path == "hybrid_rl.rollout.tools.builtin:python"


def test_bad_tool_names_are_refused_at_start():
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.tools'"):
        resolve_tools(["no_such_pkg.tools:calc"])
    with pytest.raises(ValueError, match="type hints and a docstring"):
        resolve_tools(["json:dumps"])
    with pytest.raises(ValueError, match="names a tool twice"):
        resolve_tools([f"{M}:echo", f"{M}:echo"])


def test_an_environments_public_methods_are_its_tools():
    env = load_environment(f"{M}:Counter")
    assert env.methods == ("increment",) and env.has_reward
    assert env.schemas[0]["function"]["name"] == "increment"


def test_parsers_read_calls_and_report_malformed_ones():
    ok, bad = hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and <tool_call>{oops</tool_call>')
    assert ok == ToolCall("f", {"x": 1}) and not bad.name and "not valid JSON" in bad.error
    assert hermes("no call here") == []
    assert llama3_json('{"name": "f", "parameters": {"x": 2}}') == [ToolCall("f", {"x": 2})]
    assert mistral('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 3}}]') == [ToolCall("f", {"x": 3})]
    assert "JSON object" in hermes('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')[0].error


@pytest.fixture(scope="module")
def runner():
    r = ToolRunner(resolve_tools([f"{M}:{n}" for n in ("echo", "hang", "stubborn", "crash", "flood", "fail")]
                                 + ["python"]), workers=2, timeout_s=1.5, grace_s=1.0, max_chars=200)
    yield r
    r.close()


def _calls(*calls):
    return [ToolRequest(ToolCall(n, a)) for n, a in calls]


def test_hang_crash_flood_and_errors_are_bounded_and_cost_their_call_only(runner):
    start = time.monotonic()
    res = runner.run(_calls(("echo", {"text": "a"}), ("hang", {"seconds": 30}), ("echo", {"text": "b"}),
                            ("stubborn", {"seconds": 30}), ("echo", {"text": "c"}), ("crash", {"code": 3}),
                            ("echo", {"text": "d"}), ("flood", {"n": 10**7}), ("fail", {"message": "no"}),
                            ("echo", {"wrong": 1}), ("nope", {})))
    took = time.monotonic() - start
    assert [r.status for r in res] == ["ok", "timeout", "ok", "infra", "ok", "infra", "ok", "ok", "error", "error",
                                       "error"]
    assert [res[i].text for i in (0, 2, 4, 6)] == ["a", "b", "c", "d"]
    assert "timed out" in res[1].text and "killed" in res[3].text and "died" in res[5].text
    assert len(res[7].text) < 260 and "characters cut" in res[7].text
    assert "ValueError: no" in res[8].text and "unexpected keyword" in res[9].text and "unknown tool" in res[10].text
    assert took < 20, took
    assert runner.run(_calls(("echo", {"text": "after"})))[0].text == "after"  # the workers were replaced


def test_python_tool_runs_in_the_sandbox_bounded(runner):
    out = runner.run(_calls(("python", {"code": "print(12345 * 6789)"}), ("python", {"code": "while True: pass"}),
                            ("python", {"code": "1/0"})))
    assert out[0].status == "ok" and out[0].text.strip() == str(12345 * 6789)
    # the sandbox's own limit ends the loop, or (on a loaded machine) the worker's, a moment later: bounded either way
    assert "ran out of time" in out[1].text or out[1].status == "timeout"
    assert "ZeroDivisionError" in out[2].text


def test_long_tool_results_are_cut_in_the_middle_with_a_marker(runner):
    from hybrid_rl.rollout.chat_template import FAMILIES, ToolSuffix

    tok = tokenizer_for("qwen2.5")
    loop = ToolLoop(tok, ToolSuffix(tok, FAMILIES["chatml"]), hermes, runner, TurnLimits(2, 2, 20, 100))
    text = " ".join(str(i) for i in range(200))
    cut = loop._cut(text)
    assert cut.startswith("0 1 2") and cut.endswith("198 199") and "tokens truncated" in cut
    marker = TRUNCATION_MARKER.format(n=len(tok(text)["input_ids"]) - 20)
    assert len(tok(cut)["input_ids"]) <= 20 + len(tok(marker)["input_ids"]) + 2  # (+2: merges at the seams)
    assert loop._cut("short") == "short"
