"""A GRPO run whose tool is an MCP server's: `rollout.tools=[mcp:<command>]` with a small stdio server the run starts
(each tool worker connects to it), 2 steps colocated on real vLLM and FSDP; every turn calls the server's `add`."""

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_torchrun
from tests.e2e.conftest import tiny_overrides

WORKER = Path(__file__).parent / "workers" / "run_recipes.py"
SERVER = Path(__file__).parents[1] / "unit" / "rollout" / "mcp_server.py"
pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)
def test_grpo_with_an_mcp_servers_tool_runs_two_steps(tiny_models, task_files, tmp_path):
    overrides = tiny_overrides(tiny_models["qwen2"], task_files, tmp_path / "mcp", **{
        "rollout.max_new_tokens": 48, "data.apply_chat_template": "true", "trainer.micro_batch_tokens": 512,
        "data.val_files": "[]", "rollout.tools": f"[mcp:{sys.executable} {SERVER}]",
        "rollout.multi_turn.parser": "tests.e2e.tools:always_add", "rollout.multi_turn.max_turn_tokens": 6,
        "rollout.multi_turn.max_turns": 3, "rollout.multi_turn.tool_workers": 1,
        "reward.fn": "tests.e2e.rewards:length_parity"})
    result = run_torchrun(WORKER, json.dumps([{"name": "mcp", "recipe": "grpo", "overrides": overrides}]),
                          tmp_path=tmp_path, timeout=1100)
    assert result["mcp"]["ok"], result["mcp"].get("error")
    steps = {d["step"]: d for d in map(json.loads, (tmp_path / "mcp" / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):
        m = steps[step]
        assert m["rollout/tool_call_rate"] == 1.0 and m["rollout/turns_mean"] >= 2
        assert m["rollout/tool_errors"] == 0 and m["rollout/infra_failed_rate"] == 0
        assert m["rollout/logprob_diff_max"] < 1e-3 and "actor/pg_loss" in m
