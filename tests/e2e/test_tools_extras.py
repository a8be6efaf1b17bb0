"""GRPO runs with the tool sources and environments beyond Python functions, colocated on real vLLM and FSDP, in one
launch: 2 steps whose tool is a small stdio MCP server's (`rollout.tools=[mcp:<command>]`, each tool worker connects
to it), then 2 steps with an environment that rewards each step and answers as the user (`EnvReply`)."""

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_torchrun
from tests.e2e.conftest import tiny_overrides

WORKER = Path(__file__).parent / "workers" / "run_recipes.py"
SERVER = Path(__file__).parents[1] / "integration" / "rollout" / "mcp_server.py"
pytestmark = pytest.mark.slow


def _overrides(tiny_models, task_files, out, **extra):
    return tiny_overrides(tiny_models["qwen2"], task_files, out, **{
        "rollout.max_new_tokens": 96, "data.apply_chat_template": "true", "trainer.micro_batch_tokens": 512,
        "data.val_files": "[]", "rollout.multi_turn.max_turn_tokens": 6, "rollout.multi_turn.max_turns": 3,
        "rollout.multi_turn.tool_workers": 1, "reward.fn": "tests.e2e.rewards:length_parity", **extra})


def _steps(path: Path) -> dict[int, dict]:
    return {d["step"]: d for d in map(json.loads, path.read_text().splitlines()) if "actor/pg_loss" in d}


@pytest.mark.timeout(1500)
def test_grpo_with_an_mcp_tool_and_with_an_environment_that_rewards_per_turn(tiny_models, task_files, tmp_path):
    mcp = _overrides(tiny_models, task_files, tmp_path / "mcp", **{
        "rollout.tools": f"[mcp:{sys.executable} {SERVER}]", "rollout.multi_turn.parser": "tests.e2e.tools:always_add"})
    quiz = _overrides(tiny_models, task_files, tmp_path / "quiz", **{
        "rollout.environment": "tests.e2e.tools:Quiz", "rollout.multi_turn.parser": "tests.e2e.tools:always_check"})
    result = run_torchrun(WORKER, json.dumps([{"name": "mcp", "recipe": "grpo", "overrides": mcp},
                                              {"name": "quiz", "recipe": "grpo", "overrides": quiz}]),
                          tmp_path=tmp_path, timeout=1400)
    for name in ("mcp", "quiz"):
        assert result[name]["ok"], result[name].get("error")
        steps = _steps(tmp_path / name / "metrics.jsonl")
        assert sorted(steps) == [1, 2]
        for m in steps.values():
            assert m["rollout/tool_call_rate"] == 1.0 and m["rollout/turns_mean"] >= 2
            assert m["rollout/tool_errors"] == 0 and m["rollout/infra_failed_rate"] == 0
            assert m["rollout/logprob_diff_max"] < 1e-3
    for m in _steps(tmp_path / "quiz" / "metrics.jsonl").values():
        # every answered check is worth 0.25 (each trajectory has 1 or 2 before its last turn), and the
        # environment reward (their sum) is part of the step's reward
        assert 0.25 <= m["rollout/turn_reward_mean"] <= 0.5 and m["rollout/context_tokens_mean"] > 0
