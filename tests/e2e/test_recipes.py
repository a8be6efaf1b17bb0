"""Every recipe runs end to end under torchrun (2 ranks, real vLLM, real FSDP) and logs what users read."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_torchrun
from tests.e2e.conftest import tiny_overrides

WORKER = Path(__file__).parent / "workers" / "run_recipes.py"
pytestmark = pytest.mark.slow

COMMON_KEYS = {
    "actor/grad_norm", "actor/lr", "timing/step_s", "timing/update_s", "throughput/tokens_per_s",
    "memory/peak_gib", "train/skipped_steps",
}
ROLLOUT_KEYS = {
    "response/length_mean", "response/length_max", "response/clip_ratio", "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max", "timing/rollout_s", "timing/sync_s", "timing/switch_s", "timing/old_logp_s",
    "sync/bytes_per_rank", "throughput/generated_tokens_per_s",
}
REWARD_KEYS = {"reward/mean", "reward/std", "reward/min", "reward/max", "reward/math/mean", "reward/timeouts",
               "reward/errors", "timing/reward_overlap_saved_s"}
PPO_ACTOR = {"actor/entropy", "actor/clip_frac", "actor/approx_kl", "actor/pg_loss"}
DPO_ACTOR = {"actor/dpo_loss", "actor/reward_accuracy", "actor/reward_margin"}
EXPECTED = {
    "grpo": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR | {"actor/kl", "timing/reference_s"},
    "ppo": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR | {"actor/kl", "critic/value_loss", "critic/explained_variance",
                                                    "critic/clip_frac", "timing/critic_s", "actor/kl_coef"},
    "dr_grpo": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR,
    "dapo": ROLLOUT_KEYS | PPO_ACTOR | {"rollout/sampling_rounds", "reward/mean"},
    "rloo": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR | {"actor/kl"},
    "reinforce_pp": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR | {"actor/kl", "actor/kl_coef"},
    "online_dpo": ROLLOUT_KEYS | REWARD_KEYS | DPO_ACTOR,
    "dpo": DPO_ACTOR,
}


def test_every_recipe_runs_two_steps_and_logs_its_metrics(tiny_models, task_files, tmp_path):
    runs = []
    for recipe in ("grpo", "ppo", "dr_grpo", "rloo", "reinforce_pp", "online_dpo"):
        runs.append({"name": recipe, "recipe": recipe,
                     "overrides": tiny_overrides(tiny_models["qwen2"], task_files, tmp_path / recipe)})
    # A random model never gets a math answer right, so every group would look alike to dynamic sampling:
    # DAPO gets a user reward (plugged in by dotted path) whose scores vary.
    runs.append({"name": "dapo", "recipe": "dapo", "overrides": tiny_overrides(
        tiny_models["qwen2"], task_files, tmp_path / "dapo",
        **{"reward.fn": "tests.e2e.rewards:length_parity", "algorithm.overlong_buffer": 4})})
    dpo = tiny_overrides(tiny_models["qwen2"], dict(task_files, train=task_files["prefs"]), tmp_path / "dpo")
    runs.append({"name": "dpo", "recipe": "dpo", "overrides": [o for o in dpo if not o.startswith("data.val")]})
    result = run_torchrun(WORKER, json.dumps(runs), tmp_path=tmp_path, timeout=1200)
    for run in runs:
        name = run["name"]
        assert result[name]["ok"], f"{name}: {result[name].get('error')}"
        out = tmp_path / name
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = {d["step"]: d for d in lines}
        assert {1, 2} <= set(steps), f"{name}: steps logged {sorted(steps)}"
        missing = (COMMON_KEYS | EXPECTED[name]) - set(steps[2])
        assert not missing, f"{name}: metrics missing {sorted(missing)}"
        assert (out / "checkpoints" / "step_2" / "COMPLETE").exists(), f"{name}: no final checkpoint"
        assert (out / "export" / "config.json").exists(), f"{name}: no export"
        assert any((out / "tensorboard").iterdir()), f"{name}: no TensorBoard events"
