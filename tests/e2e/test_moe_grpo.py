"""A tiny Qwen3-MoE through a 2-step GRPO run (the MoE recipe: GSPO's objective, rollout routing replay, activation
checkpointing), colocated on two CPU ranks: experts sharded over the ranks, synced into vLLM's fused-MoE weights and
verified each step, vLLM's routes replayed in the trainer's forwards, exported in the per-expert form transformers
and vLLM load."""

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.e2e.conftest import tiny_overrides

pytestmark = pytest.mark.slow


def test_two_grpo_steps_on_a_mixture_of_experts(tiny_models, task_files, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "hybrid_rl.train",
           "--config-name=grpo_moe", *tiny_overrides(tiny_models["qwen3_moe"], task_files, out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "rollout/logprob_diff_max" in s]
    assert [s["step"] for s in trained] == [1, 2]
    for s in trained:
        assert s["rollout/logprob_diff_max"] < 1e-4  # float32 on both sides: vLLM computes what the trainer does
        # measured before the replay overrides the trainer's routers: in float32 they choose as vLLM did
        assert s["moe/router_agreement"] >= 0.99, s["moe/router_agreement"]
        assert s["moe/load_balance"] >= 1.0 and 0 < s["moe/router_entropy"] < 2.08  # ln 8: at most uniform
    from transformers import AutoModelForCausalLM

    from hybrid_rl.model.weight_files import WeightFiles

    keys = set(WeightFiles(out / "export").file_of)
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys and not any(k.endswith("gate_up_proj") for k in keys)
    model = AutoModelForCausalLM.from_pretrained(out / "export", dtype=torch.float32)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 128, 128)
