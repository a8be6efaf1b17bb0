"""Multi-turn GRPO with tools in sidecar mode, end to end: a real vLLM server, real etcd, 2 trainer ranks, the python
tool in its sandbox; synchronous (`rollout.max_staleness=0`) and asynchronous (1, with an environment beside the
python tool: `rollout.environment`). Each trajectory is one loop of token-in/token-out requests against the server;
the trained ids are those the server sampled (the trainer's recomputed log-probs match the server's on the model's
tokens), and each token keeps the version that sampled it.
In the same launch, a black-box agent (`rollout.agent`, the OpenAI client against the chat endpoint) trains the
same way: its two chained calls are one trajectory, its call that starts over a second one, and both are trained with
the episode's reward and advantage; and the same agent at `max_staleness=1`, its tokens carrying the policy versions
that sampled them."""

import json
from pathlib import Path

import pytest
import torch

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.sidecar.etcd_server import EtcdProcess
from tests.conftest import run_torchrun
from tests.e2e.conftest import tiny_overrides
from tests.e2e.test_tools import TOOL_KEYS
from tests.sidecar import trained_rows

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parents[1] / "e2e" / "workers" / "run_recipes.py"


@pytest.mark.timeout(2800)  # four server starts: about 4 x 2 min on a loaded 2-core machine
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
                "rollout.agent": "tests.e2e.tools:openai_agent", "reward.fn": "tests.e2e.rewards:length_parity"}),
            "probe": "tests.sidecar.trained_rows:record"})
        runs.append(_agent_k1_run(tiny_models, task_files, tmp_path, etcd))
        result = run_torchrun(WORKER, json.dumps(runs), tmp_path=tmp_path, timeout=2700)
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
        # three model calls per episode: the two chained ones (the tool message and template between them as context)
        # are one trajectory, the third started over: a second one, trained too (4 prompts x 4 episodes x 2)
        assert m["rollout/turns_mean"] == 3 and m["rollout/context_tokens_mean"] > 0
        assert m["rollout/infra_failed_rate"] == 0
        assert m["rollout/trajectories_per_episode"] == 2 and m["train/samples"] == 32
        # the trained ids are those the server sampled: the trainer's log-probs match the server's on them
        assert m["rollout/logprob_diff_max"] < 1e-3, m["rollout/logprob_diff_max"]
        assert "reward/agent/mean" in m, sorted(m)  # the agent's returned reward, in the rubric
    # held-out validation plays the agent too (greedy): its episodes, three model calls each
    val = [d for d in lines if "val/reward_mean" in d]
    assert val and all(d["val/rollout/turns_mean"] == 3 for d in val), val
    _check_agent_episodes(tmp_path / "agent", tiny_models["qwen2"])
    _check_agent_k1(result, tmp_path / "agent_k1")


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


def _agent_k1_run(tiny_models, task_files, tmp_path: Path, etcd: EtcdProcess) -> dict:
    """The agent at `max_staleness=1` (no held-out validation: the synchronous agent run has it)."""
    return {"name": "agent_k1", "recipe": "grpo", "probe": "tests.sidecar.trained_rows:record",
            "overrides": tiny_overrides(tiny_models["qwen2"], task_files, tmp_path / "agent_k1", **{
                "rollout.mode": "sidecar", "sidecar.etcd": etcd.endpoint, "sidecar.port": free_port(),
                "rollout.kv_cache_gb": 0.125, "rollout.max_new_tokens": 48, "trainer.micro_batch_tokens": 512,
                "rollout.max_staleness": 1, "rollout.agent": "tests.e2e.tools:openai_agent",
                "reward.fn": "tests.e2e.rewards:length_parity", "data.val_files": "[]"})}


def _episodes(rows: list[dict]) -> list[list[dict]]:
    by_episode: dict[int, list[dict]] = {}
    for r in rows:
        by_episode.setdefault(r["episode"], []).append(r)
    return list(by_episode.values())


def _check_agent_episodes(out: Path, model: str) -> None:
    """Both trajectories of every episode are trained, with the episode's reward (the agent's return, judged on its
    first reply, plus `length_parity` judged on the last trajectory) and its GRPO advantage: group statistics over each
    prompt's 4 episodes, not their 8 trajectories."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    for step in (1, 2):
        rows = trained_rows.load(out, step)
        assert [r["uid"] for r in rows] == list(range(32)), [r["uid"] for r in rows]  # each trained once
        episodes = _episodes(rows)
        assert len(episodes) == 16 and all([r["part"] for r in e] == [0, 1] for e in episodes)
        groups: dict[int, list[dict]] = {}
        for first, last in episodes:
            assert (first["group"], first["score"]) == (last["group"], last["score"])
            assert first["advantage"] == pytest.approx(last["advantage"], abs=1e-6)
            reply = first["response_ids"][: first["loss_mask"].index(False)]  # the first call's sampled ids
            agent = float(len(tok.decode(reply, skip_special_tokens=True)) % 2)
            parity = float(len(tok.decode(last["response_ids"], skip_special_tokens=True)) % 2 == 0)
            assert last["parts"] == {"length_parity": parity, "agent": agent}, (last["parts"], parity, agent)
            assert last["score"] == pytest.approx(parity + agent)
            groups.setdefault(last["group"], []).append(last)
        assert sorted(len(g) for g in groups.values()) == [4] * 4
        for members in groups.values():
            s = torch.tensor([r["score"] for r in members], dtype=torch.float64)
            expected = (s - s.mean()) / (s.std() + 1e-6)
            assert [r["advantage"] for r in members] == pytest.approx(expected.tolist(), abs=1e-4)


def _check_agent_k1(result: dict, out: Path) -> None:
    """At `max_staleness=1` every token of every trajectory (sampled ones and the agent's context) carries the policy
    version that sampled it, and the staleness metrics are those of these versions."""
    assert result["agent_k1"]["ok"], result["agent_k1"].get("error")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {d["step"]: d for d in lines if "actor/pg_loss" in d}
    assert set(steps) == {1, 2}, sorted(steps)
    for step, m in steps.items():
        rows = trained_rows.load(out, step)
        # an episode dropped as an infrastructure failure trains nothing (seen once in three runs on a loaded machine, at
        # step 1; its cause is logged since): at most one, and every other episode trains both its trajectories
        failed = round(m["rollout/infra_failed_rate"] * 16)
        assert failed <= 1 and len(rows) == 2 * (16 - failed), (failed, len(rows))
        assert all(len(e) == 2 for e in _episodes(rows))
        assert all(len(r["versions"]) == len(r["response_ids"]) for r in rows)  # every token has its version
        ages = torch.tensor([step - 1 - v for r in rows for v, own in zip(r["versions"], r["loss_mask"], strict=True)
                             if own], dtype=torch.float64)  # the trained (sampled) tokens' staleness
        assert bool(((ages >= 0) & (ages <= 1)).all()), ages.unique()
        assert m["async/staleness_tokens_mean"] == pytest.approx(float(ages.mean()), abs=1e-6)
        assert m["async/staleness_tokens_max"] == float(ages.max())
        assert m["async/staleness_tokens_1"] == pytest.approx(float((ages == 1).double().mean()), abs=1e-6)
        assert m["rollout/trajectories_per_episode"] == 2 * (16 - failed) / 16  # a dropped episode counts, with none
        if "rollout/logprob_diff_mean_own" in m:  # the tokens of the weights trained: the server's log-probs
            assert m["rollout/logprob_diff_mean_own"] < 1e-3, m["rollout/logprob_diff_mean_own"]
    # step 1 trains what the first weights sampled; step 2 episodes sent during step 1 (some of their tokens one
    # version old)
    assert steps[1]["async/staleness_tokens_mean"] == 0 and steps[2]["async/staleness_tokens_mean"] > 0
