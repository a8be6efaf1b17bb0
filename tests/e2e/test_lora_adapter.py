"""`model.lora.sync=adapter` (the default for LoRA) in colocated mode at TP 2 on two ranks (TP 1: the LoRA case
of tests/e2e/test_resume.py, which runs it with the same log-prob check and a bitwise resume).

vLLM serves the trained adapter on the base weights sent once: after the first sync each update moves only
the adapter, and vLLM's sampling log-probs match the trainer's recomputation within the tolerance of merged
sync (tests/e2e/test_resume.py), every step, while the adapter really changes the policy.
"""

import json
from pathlib import Path

import pytest

from tests.conftest import VLLM_TP2, run_torchrun
from tests.e2e.conftest import tiny_overrides

WORKER = Path(__file__).parent / "workers" / "run_recipes.py"
pytestmark = [pytest.mark.slow, VLLM_TP2]
STEPS = 3


def test_adapter_sync_matches_trainer_at_tp2(tiny_models, task_files, tmp_path):
    common = {"trainer.seed": 3, "data.val_files": "[]", "reward.fn": "tests.e2e.rewards:length_parity",
              "model.lora.rank": 8, "optim.lr": "1e-2", "trainer.total_steps": STEPS, "trainer.save_every": 0}
    runs = [{"name": f"tp{tp}", "recipe": "grpo",
             "overrides": tiny_overrides(tiny_models["qwen2"], task_files, tmp_path / f"tp{tp}",
                                         **common, **{"rollout.tp": tp})} for tp in (2,)]
    result = run_torchrun(WORKER, json.dumps(runs), nproc=2, tmp_path=tmp_path, timeout=900)
    assert all(r["ok"] for r in result.values()), result
    for tp in (2,):
        out = tmp_path / f"tp{tp}"
        m = {d["step"]: d for d in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
        assert m[STEPS]["actor/entropy"] != m[1]["actor/entropy"], "the adapter did not change the policy"
        for step in range(1, STEPS + 1):
            assert m[step]["rollout/logprob_diff_max"] < 1e-3, (tp, step, m[step])
        # Step 1 sends the base weights and the adapter; later steps the adapter alone (rank 8, fp32).
        later = {m[s]["sync/bytes_per_rank"] for s in range(2, STEPS + 1)}
        assert len(later) == 1 and 0 < later.pop() < m[1]["sync/bytes_per_rank"] / 5, m
        assert not (out / "adapter_sync").exists() or not any((out / "adapter_sync").rglob("*.safetensors"))
