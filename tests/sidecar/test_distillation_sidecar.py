"""Two runs in sidecar mode on real vLLM servers, in one launch (`run_recipes.py`: torch, vLLM's imports and the process
group start once; each run starts its own server):

* on-policy distillation, asynchronous (`rollout.max_staleness=1`): a real vLLM server samples, the trainer's
  in-process teacher scores the student's tokens beside the old-log-prob pass, and the distillation term (pure: no
  reward) trains, through the rollout correction that asynchronous runs get by default (tis);
* a mixture of experts (the tiny Qwen3-MoE, tied, float32) through the MoE recipe: its experts FSDP-sharded over
  the two ranks, each update moved through the checkpoint engine's shared memory into the server's fused-MoE
  parameters (`w13_weight`, `w2_weight`) and verified there; routing replay falls back to `old` (the servers return
  no routes); the log-prob guard set tight. After each step the server's greedy tokens equal transformers' on the
  trainer's weights and its sampled log-probs transformers' (`greedy_probe.py`)."""

import json
import math
from pathlib import Path

import pytest

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.sidecar.etcd_server import EtcdProcess
from tests.conftest import run_torchrun
from tests.e2e.conftest import tiny_overrides

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parents[1] / "e2e" / "workers" / "run_recipes.py"


@pytest.fixture(scope="module")
def runs(tiny_models, task_files, tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("sidecar_recipes")
    etcd = EtcdProcess(tmp / "etcd")
    etcd.start()
    try:
        runs = [{"name": "opd", "recipe": "opd", "overrides": tiny_overrides(
            tiny_models["qwen2"], task_files, tmp / "opd", fp32=False, **{
                "teacher.path": tiny_models["llama"], "rollout.mode": "sidecar", "sidecar.etcd": etcd.endpoint,
                "sidecar.port": free_port(), "rollout.kv_cache_gb": 0.125, "rollout.max_staleness": 1,
                "data.val_files": "[]"})},
                {"name": "moe", "recipe": "grpo_moe", "probe": "tests.sidecar.greedy_probe:after_each_step",
                 "overrides": tiny_overrides(tiny_models["qwen3_moe_tied"], task_files, tmp / "moe", **{
                     "rollout.mode": "sidecar", "sidecar.etcd": etcd.endpoint, "sidecar.port": free_port(),
                     "rollout.kv_cache_gb": 0.125, "trainer.shard_size": 2, "trainer.max_logprob_diff": 1e-3,
                     "optim.lr": "1e-2", "reward.fn": "tests.e2e.rewards:length_parity", "trainer.export": "false"})}]
        return run_torchrun(WORKER, json.dumps(runs), tmp_path=tmp, timeout=1500), tmp
    finally:
        etcd.stop()


@pytest.mark.timeout(1600)
def test_opd_recipe_in_asynchronous_sidecar_mode(runs):
    result, tmp = runs
    assert result["opd"]["ok"], result["opd"].get("error")
    steps = {d["step"]: d for d in map(json.loads, (tmp / "opd" / "metrics.jsonl").read_text().splitlines())
             if "opd/reverse_kl" in d}
    assert set(steps) == {1, 2}, sorted(steps)
    for m in steps.values():
        assert math.isfinite(m["opd/reverse_kl"]) and m["opd/reverse_kl"] != 0, m
        assert m["actor/grad_norm"] > 0 and "timing/teacher_s" in m, m  # no reward: the teacher alone trains it
        assert "async/staleness_tokens_mean" in m  # asynchronous: the tokens carry the versions that sampled them


@pytest.mark.timeout(1600)
def test_moe_recipe_in_sidecar_mode_syncs_the_experts_into_the_servers_fused_moe_weights(runs):
    result, tmp = runs
    assert result["moe"]["ok"], result["moe"].get("error")
    steps = [json.loads(line) for line in (tmp / "moe" / "metrics.jsonl").read_text().splitlines()]
    trained = {s["step"]: s for s in steps if "rollout/logprob_diff_max" in s}
    assert set(trained) == {1, 2}, sorted(trained)
    assert trained[2]["sync/bytes_per_rank"] > 0  # step 1's weights crossed the checkpoint engine before step 2
    for m in trained.values():
        assert m["rollout/logprob_diff_max"] < 1e-4, m  # float32 on both sides, under the run's own 1e-3 guard
        assert m["moe/load_balance"] >= 1.0 and "moe/router_agreement" in m  # `old` replay measures the router
    checks = [json.loads(line) for line in (tmp / "moe" / "greedy.jsonl").read_text().splitlines()]
    assert [c["step"] for c in checks] == [1, 2]
    assert all(c["grad_norm"] > 0 for c in checks), "the weights changed: the sync had something to move"
    for c in checks:
        assert c["vllm"] == c["hf"], f"step {c['step']}: the server's greedy tokens != transformers' on the weights"
        assert c["server_version"] == c["version"] and c["sync_bytes"] > 0, c
        assert max(c["per_server_logprob_diff"].values()) < 1e-4, c["per_server_logprob_diff"]
