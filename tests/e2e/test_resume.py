"""A run stopped after step 2 and resumed gives bitwise the same steps 3 and 4 as an uninterrupted run.

The full fine-tuning case runs on 4 ranks with `rollout.tp=2`: two data-parallel vLLM groups of two
tensor-parallel ranks each, as GPU users run (TP 2-8 with several DP groups), with the check that vLLM's
sampling log-probs match the trainer's recomputation; it replicates the model on every rank (`trainer.shard_size=1`,
HSDP), the 2-rank cases shard it. The LoRA and 8-bit AdamW cases run on 2 ranks, in one launch.
"""

import json
from pathlib import Path

import pytest

from tests.conftest import VLLM_TP2, run_torchrun
from tests.e2e.conftest import tiny_overrides

WORKER = Path(__file__).parent / "workers" / "run_recipes.py"
pytestmark = pytest.mark.slow
COMPARED = ("reward/mean", "reward/std", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/kl",
            "response/length_mean", "rollout/logprob_diff_mean")


def _metrics(path: Path) -> dict[int, dict]:
    return {d["step"]: d for d in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())}


# The two-rank variants share one launch (their six runs one after another, each its own build -> fit -> close): a
# torchrun start less. The 8-bit run goes first: its memory check reads the process's peaks, which earlier runs in
# the same process could only raise.
SHARED = ("adamw8bit", "lora")
LAYOUT = {"full": (4, 2), "lora": (2, 1), "adamw8bit": (2, 1)}  # variant -> (ranks, rollout.tp)


def _runs(variant: str, tiny_models, task_files, root: Path) -> list[dict]:
    """Straight for 4 steps; the same run stopped after step 2 and resumed to step 4 (in `root / variant`)."""
    # A reward whose scores vary even for a random model, so every step really updates the weights.
    common = {"trainer.seed": 3, "trainer.save_every": 2, "data.val_files": "[]", "rollout.tp": LAYOUT[variant][1],
              "reward.fn": "tests.e2e.rewards:length_parity",
              # The tiny model fits every rank, so auto would replicate it everywhere: the 4-rank run takes that
              # layout (HSDP, every rank whole; the sync takes slices from the rank's own copy), the 2-rank ones shard
              # each weight over both ranks (the sync's all-to-all between shards).
              "trainer.shard_size": 1 if variant == "full" else 2}
    if variant == "lora":  # the checkpoint must save and restore the adapter (and its optimizer state); vLLM gets
        # the adapter itself (model.lora.sync=adapter, the default): the log-prob check below covers it at TP 1
        common.update({"model.lora.rank": 8, "optim.lr": "1e-3"})
    if variant == "adamw8bit":  # torchao's 8-bit moments (codes and block scales) are saved and restored exactly
        common.update({"optim.name": "adamw8bit", "optim.lr": "1e-3"})
    out = root / variant
    return [
        {"name": f"{variant}/straight", "recipe": "grpo",
         "overrides": tiny_overrides(tiny_models["qwen2"], task_files, out / "straight",
                                     **common, **{"trainer.total_steps": 4})},
        {"name": f"{variant}/first_half", "recipe": "grpo",
         "overrides": tiny_overrides(tiny_models["qwen2"], task_files, out / "resumed",
                                     **common, **{"trainer.total_steps": 2})},
        {"name": f"{variant}/second_half", "recipe": "grpo",
         "overrides": tiny_overrides(tiny_models["qwen2"], task_files, out / "resumed",
                                     **common, **{"trainer.total_steps": 4, "trainer.resume": "auto"})},
    ]


@pytest.fixture(scope="module")
def shared_launch(tiny_models, task_files, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("resume")
    runs = [r for variant in SHARED for r in _runs(variant, tiny_models, task_files, root)]
    return root, run_torchrun(WORKER, json.dumps(runs), nproc=2, tmp_path=root, timeout=900)


@pytest.mark.parametrize("variant", [pytest.param("full", id="full-dp2-tp2", marks=VLLM_TP2), "lora", "adamw8bit"])
def test_resumed_run_matches_uninterrupted_run_bitwise(tiny_models, task_files, tmp_path, request, variant):
    if variant in SHARED:
        root, result = request.getfixturevalue("shared_launch")
    else:
        root = tmp_path
        result = run_torchrun(WORKER, json.dumps(_runs(variant, tiny_models, task_files, root)),
                              nproc=LAYOUT[variant][0], tmp_path=root, timeout=900)
    mine = {name: r for name, r in result.items() if name.startswith(f"{variant}/")}
    assert len(mine) == 3 and all(r["ok"] for r in mine.values()), result
    straight, resumed = _metrics(root / variant / "straight"), _metrics(root / variant / "resumed")
    written = [p for p in (root / variant / "resumed").rglob("*") if not p.is_symlink()]
    assert any(p.name == "shared.pt" for p in written)
    open_to_others = [f"{p} {oct(p.stat().st_mode)}" for p in written if p.stat().st_mode & 0o077]
    assert not open_to_others, f"the run's files are readable by other users (umask 077): {open_to_others[:5]}"
    assert sorted(resumed) == [1, 2, 3, 4]  # no step lost or logged twice
    assert straight[4]["actor/entropy"] != straight[1]["actor/entropy"], "the policy did not change: test is vacuous"
    for step in (1, 2, 3, 4):  # vLLM (each TP group) samples what the trainer computes (float32 both sides)
        assert straight[step]["rollout/logprob_diff_max"] < 1e-3, straight[step]
    for step in (3, 4):
        for key in COMPARED:
            assert resumed[step][key] == straight[step][key], f"step {step} {key}: {resumed[step][key]} != " \
                                                               f"{straight[step][key]}"
    if variant == "adamw8bit":  # the planner counts the 8-bit state: the update phase's peak within 15% of its plan
        for step in (2, 3, 4):
            ratio = straight[step]["memory/update/peak_gib"] / straight[step]["memory/update/plan_gib"]
            assert 0.85 <= ratio <= 1.15, (step, ratio)
