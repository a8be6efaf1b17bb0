"""Multi-turn GRPO with tools in sidecar mode, end to end: a real vLLM server, real etcd, 2 trainer ranks, the python
tool in its sandbox; synchronous (`rollout.max_staleness=0`) and asynchronous (1, with an environment beside the
python tool: `rollout.environment`). Each trajectory is one loop of token-in/token-out requests against the server;
the trained ids are those the server sampled (the trainer's recomputed log-probs match the server's on the model's
tokens), and each token keeps the version that sampled it.
In the same launch, a black-box agent (`rollout.agent`, the OpenAI client against the chat endpoint) trains the
same way: its two chained calls are one sample, its call that starts over an extra sample, counted."""

import json
from pathlib import Path

import pytest

from hybrid_rl.dist.etcd_server import EtcdProcess
from hybrid_rl.dist.mesh import free_port
from tests.conftest import run_torchrun
from tests.e2e.conftest import tiny_overrides
from tests.e2e.test_tools import TOOL_KEYS

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parents[1] / "e2e" / "workers" / "run_recipes.py"


@pytest.mark.timeout(2100)  # three server starts: about 3 x 2 min on a loaded 2-core machine
def test_grpo_with_the_tool_loop_and_a_black_box_agent_in_sidecar_mode(tiny_models, task_files, tmp_path):
    etcd = EtcdProcess(tmp_path / "etcd")
    etcd.start()
    try:
        runs = []
        for k in (0, 1):
            runs.append({"name": f"k{k}", "recipe": "grpo", "overrides": tiny_overrides(
                tiny_models["qwen2"], task_files, tmp_path / f"k{k}", **{
                    "rollout.mode": "sidecar", "sidecar.etcd": etcd.endpoint, "sidecar.port": free_port(),
                    "rollout.kv_cache_gb": 0.125, "rollout.max_staleness": k, "rollout.max_new_tokens": 48,
                    "data.apply_chat_template": "true", "trainer.micro_batch_tokens": 512,
                    "rollout.tools": "[python]", "rollout.multi_turn.parser": "tests.e2e.tools:always_python",
                    "rollout.multi_turn.max_turn_tokens": 6, "rollout.multi_turn.max_turns": 3,
                    "rollout.multi_turn.tool_workers": 1, "reward.fn": "tests.e2e.rewards:length_parity",
                    "algorithm.rollout_correction": "tis", "data.val_files": "[]"})})
        runs[1]["overrides"] = with_environment(runs[1]["overrides"])  # K = 1 plays an environment too
        runs.append({"name": "agent", "recipe": "grpo", "overrides": tiny_overrides(
            tiny_models["qwen2"], task_files, tmp_path / "agent", **{
                "rollout.mode": "sidecar", "sidecar.etcd": etcd.endpoint, "sidecar.port": free_port(),
                "rollout.kv_cache_gb": 0.125, "rollout.max_new_tokens": 48, "trainer.micro_batch_tokens": 512,
                "rollout.agent": "tests.e2e.tools:openai_agent", "reward.fn": "tests.e2e.rewards:length_parity"})})
        result = run_torchrun(WORKER, json.dumps(runs), tmp_path=tmp_path, timeout=2000)
    finally:
        etcd.stop()
    for k in (0, 1):
        assert result[f"k{k}"]["ok"], result[f"k{k}"].get("error")
        lines = [json.loads(x) for x in (tmp_path / f"k{k}" / "metrics.jsonl").read_text().splitlines()]
        steps = {d["step"]: d for d in lines if "actor/pg_loss" in d}
        assert set(steps) == {1, 2}, sorted(steps)
        for m in steps.values():
            assert TOOL_KEYS <= set(m), sorted(TOOL_KEYS - set(m))
            assert m["rollout/tool_call_rate"] == 1.0 and m["rollout/turns_mean"] >= 2
            assert m["rollout/infra_failed_rate"] == 0 and m["rollout/context_tokens_mean"] > 0
            if m["async/staleness_tokens_mean"] == 0:  # sampled by the weights trained: the same log-probs
                assert m["rollout/logprob_diff_max"] < 1e-3, m["rollout/logprob_diff_max"]
        # K = 1: step 2 trains trajectories sent during step 1 (measured: every token of every turn one version old)
        assert (steps[2]["async/staleness_tokens_mean"] > 0) == (k == 1)
        assert steps[1]["async/staleness_tokens_mean"] == 0
    check_environment(tmp_path / "k1")
    assert result["agent"]["ok"], result["agent"].get("error")
    lines = [json.loads(x) for x in (tmp_path / "agent" / "metrics.jsonl").read_text().splitlines()]
    steps = {d["step"]: d for d in lines if "actor/pg_loss" in d}
    assert set(steps) == {1, 2}, sorted(steps)
    for m in steps.values():
        # two model turns per sample (the chained calls), the tool message and template between them as context
        assert m["rollout/turns_mean"] == 2 and m["rollout/context_tokens_mean"] > 0
        assert m["rollout/infra_failed_rate"] == 0
        assert m["rollout/agent_extra_samples"] == 16  # every episode's third call started over: one each
        # the trained ids are those the server sampled: the trainer's log-probs match the server's on them
        assert m["rollout/logprob_diff_max"] < 1e-3, m["rollout/logprob_diff_max"]
        assert "reward/agent/mean" in m, sorted(m)  # the agent's returned reward, in the rubric
    # held-out validation plays the agent too (greedy): its episodes, two model turns each
    val = [d for d in lines if "val/reward_mean" in d]
    assert val and all(d["val/rollout/turns_mean"] == 2 for d in val), val


# -- rollout.environment in sidecar mode (the K = 1 run) --------------------------------------------------------------

def with_environment(overrides: list[str]) -> list[str]:
    """A run's overrides with the `Tally` environment: its prompt, its method called every turn beside python."""
    kept = [o for o in overrides if not o.startswith("rollout.multi_turn.parser=")]
    return [*kept, "rollout.environment=tests.e2e.tools:Tally", "rollout.multi_turn.parser=tests.e2e.tools:python_and_tally"]


def check_environment(out: Path) -> None:
    """Each trajectory's environment got its row (else its reward is -100), its `tally` ran once per tool turn on
    that instance, and its `reward()` reached the scores: the environment's mean reward is half the calls (python and
    tally each turn). The run's own checks (above) cover the ids and log-probs, its prompt among them."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [d for d in lines if "actor/pg_loss" in d]
    assert len(steps) == 2, steps
    for m in steps:
        assert m["reward/environment/mean"] >= 1, m["reward/environment/mean"]
        assert m["reward/environment/mean"] * 2 == pytest.approx(m["rollout/tool_calls_mean"], abs=1e-4)
