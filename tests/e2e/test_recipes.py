"""Every recipe runs end to end under torchrun (2 ranks, real vLLM, real FSDP) and logs what users read.

All runs use the default dtypes (bf16 training compute and rollout), as users get them. PPO, with a
reference, a critic and a reward model, runs three times: without offload, then with every offload
target of every component at `cpu`, then at `disk`; the numbers and final weights must be bitwise equal.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import TIMING, run_torchrun
from tests.e2e.conftest import tiny_overrides

WORKER = Path(__file__).parent / "workers" / "run_recipes.py"
pytestmark = [pytest.mark.slow, TIMING]  # the reward overlap is checked in seconds measured

COMMON_KEYS = {
    "actor/grad_norm", "actor/lr", "timing/step_s", "timing/update_s", "throughput/tokens_per_s",
    "memory/peak_gib", "train/skipped_steps", "memory/update/peak_gib", "memory/update/plan_gib",
}
CORRECTION_KEYS = tuple(f"rollout_correction/{k}" for k in ("is_ratio_mean", "is_ratio_max", "truncated_frac",
                                                              "masked_frac", "kl_k1", "kl_k3"))
ROLLOUT_KEYS = {
    "response/length_mean", "response/length_max", "response/clip_ratio", "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max", "timing/rollout_s", "timing/sync_s", "timing/switch_s",
    "sync/bytes_per_rank", "throughput/generated_tokens_per_s", "memory/rollout/peak_gib", "memory/rollout/plan_gib",
    *CORRECTION_KEYS,
}
REWARD_KEYS = {"reward/mean", "reward/std", "reward/min", "reward/max", "reward/math/mean", "reward/timeouts",
               "reward/errors", "timing/reward_overlap_saved_s"}
# A separate old-log-prob pass runs only where the batch gets several optimizer steps (ppo: 2 mini-batches)
# or the KL penalty is in the reward; elsewhere the update's own forward pass gives the old log-probs.
OLD_LOGP_PASS = {"timing/old_logp_s", "memory/old_logp/peak_gib"}
WITH_OLD_LOGP_PASS = {"ppo", "reinforce_pp", "ppo_lora"}
PPO_ACTOR = {"actor/entropy", "actor/clip_frac", "actor/approx_kl", "actor/pg_loss"}
DPO_ACTOR = {"actor/dpo_loss", "actor/reward_accuracy", "actor/reward_margin"}
EXPECTED = {
    "grpo": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR | {"actor/kl", "timing/reference_s", "actor/prefix_saved_frac"},
    "ppo": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR | {"actor/kl", "critic/value_loss", "critic/explained_variance",
                                                    "critic/clip_frac", "timing/critic_s", "actor/kl_coef",
                                                    "memory/critic_update/peak_gib", "timing/reward_model_s"},
    "dr_grpo": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR,
    "dapo": ROLLOUT_KEYS | PPO_ACTOR | {"rollout/sampling_rounds", "reward/mean"},
    "rloo": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR | {"actor/kl"},
    "reinforce_pp": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR | {"actor/kl", "actor/kl_coef"},
    "online_dpo": ROLLOUT_KEYS | DPO_ACTOR | {"reward/mean", "reward/length_parity/mean", "train/pairs",
                                              "train/pairs_used"},
    "grpo_rm": ROLLOUT_KEYS | REWARD_KEYS | PPO_ACTOR | {"timing/reward_model_s"},
    "grpo_lora": ROLLOUT_KEYS | PPO_ACTOR | {"actor/kl", "timing/reference_s", "reward/length_parity/mean"},
    "ppo_lora": ROLLOUT_KEYS | PPO_ACTOR | {"actor/kl", "critic/value_loss", "reward/length_parity/mean"},
    "dpo": DPO_ACTOR | {"train/pairs", "train/pairs_used"},
}
OFFLOAD = ("actor_params", "actor_grads", "actor_optim", "reference", "critic", "reward_model")
# What each run moves (OffloadManager components). Gradients are freed at every optimizer step, so at the
# switch to rollout `actor_grads` finds nothing to move; the critic's AdamW state goes with `offload.critic`.
MOVED = {"actor.params", "actor.optim", "reference", "critic", "critic.optim", "reward_model"}
NOT_NUMBERS = ("timing/", "memory/", "throughput/")  # wall-clock and memory readings differ run to run


def test_every_recipe_runs_two_steps_and_logs_its_metrics(tiny_models, task_files, reward_model, tmp_path,
                                                          model_without_pad_token):
    def overrides(name, model=tiny_models["qwen2"], data=task_files, **extra):
        return tiny_overrides(model, data, tmp_path / name, fp32=False, **extra)

    runs = []
    # RLOO with truncated IS (its old log-probs come from the update's own forward; PPO's from a separate pass),
    # truncating at 1.001 so that bf16's mismatch (ratios within ~2% of 1 here) gets truncated somewhere.
    # GRPO packs each group's samples prefix-shared (its prompt once per micro-batch) in the reference pass and the
    # update: the trainer's path of `trainer.prefix_share`, whose equality to the unshared passes the unit tests prove
    # (on by default on CPU); Dr. GRPO packs every sample apart, the other path.
    correction = {"rloo": {"algorithm.rollout_correction": "tis", "algorithm.rollout_correction_high": 1.001},
                  "grpo": {"trainer.prefix_share": "true"}, "dr_grpo": {"trainer.prefix_share": "false"}}
    for recipe in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        runs.append({"name": recipe, "recipe": recipe, "overrides": overrides(recipe, **correction.get(recipe, {}))})
    # Online DPO pairs best against worst by reward: a reward whose scores vary gives it pairs to train.
    runs.append({"name": "online_dpo", "recipe": "online_dpo", "overrides": overrides(
        "online_dpo", **{"reward.fn": "tests.e2e.rewards:length_parity"})})
    # PPO with every component that can be offloaded: actor, reference (KL), critic and a reward model; with
    # activation checkpointing, which recomputes the actor's and the critic's blocks.
    ppo_keys = {"reward.model_path": reward_model, "model.activation_checkpointing": "true"}
    runs.append({"name": "ppo", "recipe": "ppo", "overrides": overrides("ppo", **ppo_keys)})
    # A random model never gets a math answer right, so every group would look alike to dynamic sampling:
    # DAPO gets a user reward (plugged in by dotted path) whose scores vary.
    runs.append({"name": "dapo", "recipe": "dapo", "overrides": overrides(
        "dapo", **{"reward.fn": "tests.e2e.rewards:length_parity", "algorithm.overlong_buffer": 4})})
    # LoRA: the actor trains an adapter; the reference is its own frozen base. GRPO gives vLLM the adapter
    # (model.lora.sync=adapter, the default), PPO merged weights.
    for recipe, sync in (("grpo", "adapter"), ("ppo", "merged")):
        runs.append({"name": f"{recipe}_lora", "recipe": recipe, "overrides": overrides(
            f"{recipe}_lora", **{"model.lora.rank": 8, "optim.lr": "1e-3", "model.lora.sync": sync,
                                 "reward.fn": "tests.e2e.rewards:length_parity"})})
    # GRPO with a neural reward model added to the rule reward, and with a slow rule reward (overlap).
    # (with activation checkpointing on, and a tokenizer without a pad token: packing needs none)
    runs.append({"name": "grpo_rm", "recipe": "grpo", "overrides": overrides(
        "grpo_rm", model_without_pad_token, **{"reward.model_path": reward_model,
                                               "model.activation_checkpointing": "true"})})
    runs.append({"name": "grpo_slow_reward", "recipe": "grpo", "overrides": overrides(
        "grpo_slow_reward", **{"reward.fn": "tests.e2e.rewards:slow", "trainer.total_steps": 1,
                               "data.val_files": "[]", "algorithm.old_logp_pass": "always",
                               # passes long enough for the overlap to be measured (a tiny model's shared,
                               # single-micro-batch passes took 18 ms, under a reward worker's start)
                               "trainer.prefix_share": "false", "trainer.micro_batch_tokens": 64})})
    dpo = overrides("dpo", data=dict(task_files, train=task_files["prefs"]))
    runs.append({"name": "dpo", "recipe": "dpo", "overrides": [o for o in dpo if not o.startswith("data.val")]})
    for target in ("cpu", "disk"):  # last: the PPO run again, everything offloaded
        runs.append({"name": f"ppo_offload_{target}", "recipe": "ppo", "overrides": overrides(
            f"ppo_offload_{target}", **ppo_keys, **{f"offload.{k}": target for k in OFFLOAD})})
    result = run_torchrun(WORKER, json.dumps(runs), tmp_path=tmp_path, timeout=1200)
    failed = {name: r["error"] for name, r in result.items() if not r["ok"]}
    assert not failed, failed
    _check_overlap(tmp_path / "grpo_slow_reward")
    _check_pairs(tmp_path)
    _check_memory_plan(tmp_path / "grpo")
    _check_exports(tmp_path)
    _check_offload_is_bitwise(tmp_path, result)
    for run in runs:
        name = run["name"]
        if name == "grpo_slow_reward":
            continue
        assert result[name]["ok"], f"{name}: {result[name].get('error')}"
        out = tmp_path / name
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = {d["step"]: d for d in lines}
        assert {1, 2} <= set(steps), f"{name}: steps logged {sorted(steps)}"
        name = "ppo" if name.startswith("ppo_offload") else name
        expected = COMMON_KEYS | EXPECTED[name] | (OLD_LOGP_PASS if name in WITH_OLD_LOGP_PASS else set())
        missing = expected - set(steps[2])
        assert not missing, f"{name}: metrics missing {sorted(missing)}"
        if name not in WITH_OLD_LOGP_PASS:
            assert not OLD_LOGP_PASS & set(steps[2]), f"{name}: ran an old-log-prob pass it did not need"
        if name == "grpo":  # trainer.prefix_share: each rank's groups packed with their prompt once
            assert all(steps[s]["actor/prefix_saved_frac"] > 0 for s in (1, 2)), steps
        if name == "dr_grpo":
            assert "actor/prefix_saved_frac" not in steps[2], steps[2]
        if expected & set(CORRECTION_KEYS):
            _check_correction(name, steps, applied=name == "rloo")
        assert (out / "checkpoints" / "step_2" / "COMPLETE").exists(), f"{name}: no final checkpoint"
        assert (out / "export" / "config.json").exists(), f"{name}: no export"
        assert any((out / "tensorboard").iterdir()), f"{name}: no TensorBoard events"


# GSPO and CISPO split each batch into 4 mini-batches (their ratios matter off-policy), and on-policy distillation
# needs the student's log-probs before the update: all three run a separate old-log-prob pass.
PARITY = {"reward.fn": "tests.e2e.rewards:length_parity"}
OBJECTIVE_RUNS = {
    "gspo": (PARITY, ROLLOUT_KEYS | PPO_ACTOR | OLD_LOGP_PASS | {"reward/mean", "reward/length_parity/mean"}),
    "cispo": (PARITY, ROLLOUT_KEYS | PPO_ACTOR | OLD_LOGP_PASS | {"reward/mean", "reward/length_parity/mean"}),
    # Pure distillation (no reward) from a teacher of another architecture with the student's tokenizer, offloaded
    # to disk between its passes.
    "opd": ({"offload.teacher": "disk"}, ROLLOUT_KEYS | PPO_ACTOR | OLD_LOGP_PASS | {"opd/reverse_kl",
                                                                                   "timing/teacher_s"}),
}


def test_objective_recipes_run_two_steps_and_log_their_metrics(tiny_models, task_files, tmp_path):
    """The GSPO, CISPO and on-policy distillation recipes as shipped (bf16). GSPO and CISPO get a reward whose
    scores vary, so that they train; OPD has no reward at all, so whatever it trains comes from the teacher."""
    teacher = {"opd": {"teacher.path": tiny_models["llama"]}}
    runs = [{"name": name, "recipe": name, "overrides": tiny_overrides(
        tiny_models["qwen2"], task_files, tmp_path / name, fp32=False, **extra, **teacher.get(name, {}))}
        for name, (extra, _) in OBJECTIVE_RUNS.items()]
    result = run_torchrun(WORKER, json.dumps(runs), tmp_path=tmp_path, timeout=900)
    failed = {name: r["error"] for name, r in result.items() if not r["ok"]}
    assert not failed, failed
    for name, (_, expected) in OBJECTIVE_RUNS.items():
        steps = {d["step"]: d for d in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())}
        assert {1, 2} <= set(steps), f"{name}: steps logged {sorted(steps)}"
        missing = (COMMON_KEYS | expected) - set(steps[2])
        assert not missing, f"{name}: metrics missing {sorted(missing)}"
        numbers = PPO_ACTOR | {"actor/grad_norm"} | ({"opd/reverse_kl"} & expected)
        for step in (1, 2):
            m = steps[step]
            assert all(math.isfinite(m[k]) for k in numbers), (name, step, m)
            assert 0 <= m["actor/clip_frac"] <= 1, (name, step)
        assert max(steps[s]["actor/grad_norm"] for s in (1, 2)) > 0, name  # advantages vary: the objective trains
        assert (tmp_path / name / "checkpoints" / "step_2" / "COMPLETE").exists(), f"{name}: no final checkpoint"
    assert result["opd"]["offloaded"].get("teacher", 0) > 0  # the teacher went to disk between its passes
    opd = [d for d in map(json.loads, (tmp_path / "opd" / "metrics.jsonl").read_text().splitlines())
           if "opd/reverse_kl" in d]  # the training steps' lines (not the validation lines)
    assert [d["step"] for d in opd] == [1, 2]
    assert all(d["opd/reverse_kl"] != 0 for d in opd)  # two random models: their log-probs differ
    assert "memory/teacher/plan_gib" in opd[-1]  # the planner counts the teacher's pass

def _check_correction(name: str, steps: dict[int, dict], *, applied: bool) -> None:
    """Rollout-correction metrics are finite and in range every step; without a correction nothing is cut."""
    for step, m in steps.items():
        if CORRECTION_KEYS[0] not in m:  # a validation line
            continue
        c = {k.split("/")[1]: m[k] for k in CORRECTION_KEYS}
        assert all(math.isfinite(v) for v in c.values()), (name, step, c)
        assert 0 < c["is_ratio_mean"] <= c["is_ratio_max"] and c["kl_k3"] >= 0, (name, step, c)
        assert 0 <= c["truncated_frac"] <= 1 and c["masked_frac"] == 0, (name, step, c)  # tis truncates, never masks
        assert (c["truncated_frac"] > 0) == applied, (name, step, c)


def _check_memory_plan(out: Path) -> None:
    """The planner's accounting holds on a small model: each phase's measured peak (every rank's VmHWM, the
    maximum) within 20% of its plan, once AdamW's state exists (step 2; start-up from step 1). The process and
    vLLM's runtime are most of it here; `benchmarks/scale.py` checks 0.5B and 3B models to 15%."""
    steps = {d["step"]: d for d in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    checked = {}
    for step, d in ((1, steps[1]), (2, steps[2])):
        for key in d:
            phase = key.split("/")[1] if key.startswith("memory/") and key.endswith("/plan_gib") else None
            if phase and (step == 2) != (phase == "startup"):
                checked[phase] = d[f"memory/{phase}/peak_gib"] / d[key]
    assert {"startup", "sync", "rollout", "update"} <= set(checked), checked
    assert all(0.8 <= r <= 1.2 for r in checked.values()), checked


def _check_pairs(root: Path) -> None:
    """Every preference pair is trained (none dropped for landing on two ranks or micro-batches)."""
    for name, expected in (("dpo", 4), ("online_dpo", None)):  # offline: one pair per prompt, 4 prompts a step
        for d in map(json.loads, (root / name / "metrics.jsonl").read_text().splitlines()):
            if "train/pairs" in d:
                assert d["train/pairs_used"] == d["train/pairs"] == (expected or d["train/pairs"]), (name, d)
                assert d["train/pairs"] > 0, (name, d)


def _check_offload_is_bitwise(root: Path, result: dict) -> None:
    """Every offload target of every component, at `cpu` and at `disk`: every logged number and every final
    weight (the export; the checkpoint's actor and critic with their AdamW state) bitwise as without offload."""
    assert result["ppo"]["offloaded"] == {}
    want_numbers, want_weights = _numbers(root / "ppo"), _final_weights(root / "ppo")
    for target in ("cpu", "disk"):
        name = f"ppo_offload_{target}"
        moved = result[name]["offloaded"]
        assert {k for k, v in moved.items() if v > 0} == MOVED and moved["actor.grads"] == 0, (name, moved)
        assert _numbers(root / name) == want_numbers, name
        got = _final_weights(root / name)
        assert got.keys() == want_weights.keys(), name
        differ = [k for k, v in want_weights.items() if not torch.equal(got[k], v)]
        assert not differ, (name, differ[:5])
    assert (root / "ppo_offload_disk" / "offload").is_dir()  # the files were there ...
    assert not list((root / "ppo_offload_disk" / "offload").iterdir())  # ... and are deleted when the run ends


def _numbers(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(NOT_NUMBERS)} for x in lines]


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    flat = {f"export/{k}": v for k, v in load_file(out / "export" / "model.safetensors").items()}
    # Checkpoint format 2 keeps one DCP folder per rank holding that rank's shards (node-local disks): its data
    # files, byte for byte (equal states write equal bytes), stand for the actor and critic with their AdamW state.
    for comp in ("actor", "critic"):
        for data in sorted((out / "checkpoints" / "step_2" / comp).glob("rank*/*.distcp")):
            flat[f"{comp}/{data.parent.name}/{data.name}"] = torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8)
        assert any(k.startswith(f"{comp}/rank") for k in flat), f"{out}: no {comp} checkpoint data"
    return flat



def _check_overlap(out: Path) -> None:
    """Scoring (T) runs in reward workers while the ranks run their model passes (M): the step waits ~max(T, M)."""
    from tests.e2e.rewards import SLOW_REWARD_S

    m = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    t = m["timing/reward_score_s"]
    passes = m["timing/old_logp_s"] + m["timing/reference_s"]  # the run asks for the old-log-prob pass
    assert t >= 8 * SLOW_REWARD_S * 0.95  # 16 samples over 2 ranks x 1 worker: 8 sleeps each
    waited = passes + m["timing/reward_wait_s"]
    saved = m["timing/reward_overlap_saved_s"]  # T minus the time the step actually waited for scores
    assert saved > 0.7 * min(t, passes), (t, passes, saved)  # most of the possible overlap happened
    assert waited < t + passes - 0.7 * min(t, passes), (t, passes, waited)  # ~max(T, M), not T + M


def _greedy(jobs: dict[str, tuple]) -> dict[str, list[list[int]]]:
    """Each job's greedy continuations ((kind, model folder[, adapter folder]), as `workers/greedy.py` takes them),
    all in one process."""
    import subprocess
    import sys

    from tests.conftest import REPO

    r = subprocess.run([sys.executable, str(Path(__file__).parent / "workers" / "greedy.py"),
                        json.dumps([[kind, *map(str, paths)] for kind, *paths in jobs.values()])],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(zip(jobs, json.loads(r.stdout.strip().splitlines()[-1]), strict=True))


def _check_exports(root: Path) -> None:
    """Exports load in transformers and in vLLM and give the same greedy text; LoRA: merged == adapter on base."""
    full = root / "grpo" / "export"
    lora = root / "grpo_lora" / "export"
    base = json.loads((lora / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    g = _greedy({"full_hf": ("hf", full), "full_vllm": ("vllm", full), "lora_hf": ("hf", lora),
                 "lora_peft": ("peft", Path(base), lora / "adapter"), "lora_vllm": ("vllm", lora)})
    assert g["full_hf"] == g["full_vllm"]
    assert g["lora_hf"] == g["lora_peft"]
    assert g["lora_hf"] == g["lora_vllm"]
    lines = [json.loads(x) for x in (root / "grpo_lora" / "metrics.jsonl").read_text().splitlines()]
    sent = [d["sync/bytes_per_rank"] for d in lines if "sync/bytes_per_rank" in d]
    full_sent = [d["sync/bytes_per_rank"] for d in map(json.loads, (root / "grpo" / "metrics.jsonl").read_text()
                                                            .splitlines()) if "sync/bytes_per_rank" in d]
    assert sent[-1] < 0.8 * full_sent[-1], (sent, full_sent)  # only the LoRA-touched layers are sent again
