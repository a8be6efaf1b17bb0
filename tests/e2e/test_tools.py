"""Multi-turn GRPO with tools, colocated, end to end: 2 ranks, real vLLM, real FSDP, the python tool in its sandbox.

A random model never writes a tool call, so the run plugs in a parser that reads one from every turn
(`tests.e2e.tools:always_python`) and bounds each turn (`rollout.multi_turn.max_turn_tokens`): every trajectory then
alternates model turns and tool results until its budget ends. The trainer's recomputed log-probs equal the
engine's on the model's tokens (fp32): the ids trained are the ids sampled, and the mask is where they are. In the
same launch, one step at `rollout.tp=2` (the 2 ranks one vLLM TP group) with an environment: each trajectory's
calls run on one rank of the group and the answers are shared, so both ranks send identical requests.
"""

import json
from pathlib import Path

import pytest

from tests.conftest import VLLM_TP2, run_torchrun
from tests.e2e.conftest import tiny_overrides

WORKER = Path(__file__).parent / "workers" / "run_recipes.py"
pytestmark = [pytest.mark.slow, VLLM_TP2]  # its launch's second run is at rollout.tp=2

TOOL_KEYS = {"rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_call_rate", "rollout/malformed_calls",
             "rollout/tool_errors", "rollout/tool_timeouts", "rollout/infra_failed_rate", "rollout/model_tokens_mean",
             "rollout/context_tokens_mean", "timing/tool_s", "rollout/tool_time_share"}


@pytest.mark.timeout(1200)  # two runs in one launch: tp=1 (2 steps), then tp=2 (1 step)
def test_grpo_with_the_tool_loop_colocated_runs_two_steps(tiny_models, task_files, tmp_path):
    overrides = tiny_overrides(tiny_models["qwen2"], task_files, tmp_path / "tools", **{
        "rollout.max_new_tokens": 48, "data.apply_chat_template": "true", "trainer.micro_batch_tokens": 512,
        "rollout.tools": "[python,tests.e2e.tools:lookup]", "rollout.multi_turn.parser": "tests.e2e.tools:always_python",
        "rollout.multi_turn.max_turn_tokens": 6, "rollout.multi_turn.max_turns": 3,
        "rollout.multi_turn.tool_workers": 1, "reward.fn": "tests.e2e.rewards:length_parity"})
    probe = "tests.e2e.tools:schedules_agree"  # before each run fits: both multi-turn schedules, greedy
    result = run_torchrun(WORKER, json.dumps([{"name": "tools", "recipe": "grpo", "overrides": overrides,
                                               "probe": probe},
                                              {"name": "tp2", "recipe": "grpo", "probe": probe,
                                               "overrides": tp2_overrides(tiny_models, task_files, tmp_path)}]),
                          tmp_path=tmp_path, timeout=1100)
    assert result["tools"]["ok"], result["tools"].get("error")
    steps = {d["step"]: d for d in map(json.loads, (tmp_path / "tools" / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):
        m = steps[step]
        assert TOOL_KEYS <= set(m), sorted(TOOL_KEYS - set(m))
        assert m["rollout/tool_call_rate"] == 1.0 and m["rollout/tool_calls_mean"] >= 1
        assert m["rollout/turns_mean"] >= 2 and m["rollout/context_tokens_mean"] > 0
        assert m["rollout/tool_errors"] == 0 and m["rollout/infra_failed_rate"] == 0
        assert m["rollout/logprob_diff_max"] < 1e-3, m["rollout/logprob_diff_max"]
        assert "actor/pg_loss" in m
    assert "val/rollout/tool_call_rate" in steps[2]
    assert (tmp_path / "tools" / "checkpoints" / "step_2" / "COMPLETE").exists()
    check_schedules(tmp_path / "tools")
    check_tp2(result, tmp_path)
    check_schedules(tmp_path / "tp2")


def check_schedules(out: Path) -> None:
    """The per-trajectory schedule (no turn barrier: the engine driven request by request, each trajectory's next
    turn added when its tools answer) trains what the lockstep schedule trains: on a greedy rollout of the same
    prompts, every rank holds the same samples with the same ids, loss masks and (to float noise) log-probs."""
    for rank in (0, 1):
        held = json.loads((out / f"schedules_rank{rank}.json").read_text())
        ours, lockstep = held["trajectory"], held["lockstep"]
        assert ours and [h[:3] for h in ours] == [h[:3] for h in lockstep]
        assert all(False in mask and True in mask for _, _, mask, _ in ours)  # tool results between model turns
        for (_, _, _, a), (_, _, _, b) in zip(ours, lockstep, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


# -- rollout.tp=2 with an environment: one vLLM TP group of the launch's 2 ranks --------------------------------------

def tp2_overrides(tiny_models, task_files, tmp_path) -> list[str]:
    """One step at rollout.tp=2: the python tool and the `Tally` environment (its prompt, its method, its reward)."""
    return tiny_overrides(tiny_models["qwen2"], task_files, tmp_path / "tp2", **{
        "rollout.tp": 2, "trainer.total_steps": 1, "data.val_files": "[]", "rollout.max_new_tokens": 48,
        "data.apply_chat_template": "true", "trainer.micro_batch_tokens": 512, "rollout.tools": "[python]",
        "rollout.environment": "tests.e2e.tools:Tally", "rollout.multi_turn.parser": "tests.e2e.tools:python_and_tally",
        "rollout.multi_turn.max_turn_tokens": 6, "rollout.multi_turn.max_turns": 3,
        "rollout.multi_turn.tool_workers": 1, "reward.fn": "tests.e2e.rewards:length_parity"})


def check_tp2(result: dict, tmp_path) -> None:
    """Both TP ranks sent vLLM the same trajectories (else the run hangs or stops), each call ran once on the rank
    holding its trajectory's environment, and the ids trained are those vLLM sampled."""
    assert result.get("tp2", {}).get("ok"), result.get("tp2")
    steps = [d for d in map(json.loads, (tmp_path / "tp2" / "metrics.jsonl").read_text().splitlines())
             if "actor/pg_loss" in d]
    assert len(steps) == 1, steps
    m = steps[0]
    assert TOOL_KEYS <= set(m), sorted(TOOL_KEYS - set(m))
    assert m["rollout/tool_call_rate"] == 1.0 and m["rollout/turns_mean"] >= 2
    assert m["rollout/tool_errors"] == 0 and m["rollout/infra_failed_rate"] == 0
    # the trainer's log-probs of the trained ids equal vLLM's: the ids (the environment's prompt among them) are
    # those the engine saw and sampled
    assert m["rollout/logprob_diff_max"] < 1e-3, m["rollout/logprob_diff_max"]
    # every turn called python and the environment's tally once: the reward (the calls each trajectory's own
    # instance counted) is half the calls, so each tally ran exactly once, where its environment lives
    assert m["reward/environment/mean"] >= 1
    assert m["reward/environment/mean"] * 2 == pytest.approx(m["rollout/tool_calls_mean"], abs=1e-4)
