"""Tools from an MCP server (`rollout.tools=[mcp:<command>]`): a small stdio server the test starts lists its tools
with their schemas, and the tool runner's workers call them under the usual bounds; the tool loop plays a call
through one, end to end on a scripted engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybrid_rl.rollout.chat_template import FAMILIES, ToolSuffix
from hybrid_rl.rollout.multi_turn import ToolLoop, TurnLimits
from hybrid_rl.rollout.tool_calls import ToolCall, hermes
from hybrid_rl.rollout.tools import ToolRequest, ToolRunner, resolve_tools
from hybrid_rl.rollout.tools._worker import ERROR, OK, TIMEOUT
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.types import Generation
from tests.unit.rollout.templates import tokenizer_for

SERVER = f"mcp:{sys.executable} {Path(__file__).with_name('mcp_server.py')}"


@pytest.fixture(scope="module")
def mcp_tools():
    specs = resolve_tools([SERVER, "tests.unit.rollout.templates:calc"])
    runner = ToolRunner(specs, workers=1, timeout_s=3.0, grace_s=2.0)
    yield specs, runner
    runner.close()


def test_an_mcp_servers_tools_are_listed_with_their_schemas(mcp_tools):
    specs, _ = mcp_tools
    by_name = {s.name: s for s in specs}
    assert set(by_name) == {"add", "refuse", "slow", "calc"}
    fn = by_name["add"].schema["function"]
    assert fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"]["a"]["type"] == "integer" and fn["parameters"]["required"] == ["a", "b"]
    assert by_name["add"].path == SERVER


def test_mcp_calls_run_in_the_workers_with_the_usual_bounds(mcp_tools):
    _, runner = mcp_tools
    res = runner.run([ToolRequest(ToolCall("add", {"a": 2, "b": 40})), ToolRequest(ToolCall("refuse", {"why": "no"})),
                      ToolRequest(ToolCall("slow", {"seconds": 30})), ToolRequest(ToolCall("calc", {"a": 1, "b": 1}))])
    assert (res[0].status, res[0].text) == (OK, "42")
    assert res[1].status == ERROR and res[1].text.startswith("Error:")
    assert res[2].status == TIMEOUT and "timed out after 3s" in res[2].text
    assert (res[3].status, res[3].text) == (OK, "2")


def test_the_tool_loop_plays_an_mcp_call(mcp_tools):
    specs, runner = mcp_tools
    tok = tokenizer_for("qwen2.5")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    suffix = ToolSuffix(tok, FAMILIES["chatml"], [s.schema for s in specs])
    loop = ToolLoop(tok, suffix, hermes, runner, TurnLimits(3, 3, 64, 512))
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>', "It is 42."]
    traj = Trajectory(tok("q", add_special_tokens=False)["input_ids"])

    def generate(contexts, budgets, seeds):
        ids = tok(turns[traj.turns], add_special_tokens=False)["input_ids"] + [eot]
        return [Generation(0, ids, [-0.5] * len(ids), "stop")]

    loop.run([traj], [None], generate, [0])
    assert traj.turns == 2 and traj.log[0]["status"] == "ok" and traj.log[0]["result"] == "42"
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(traj.response_ids)
