"""On-policy distillation in sidecar mode, asynchronous (`rollout.max_staleness=1`): a real vLLM server samples, the
trainer's in-process teacher scores the student's tokens beside the old-log-prob pass, and the distillation term
(pure: no reward) trains, through the rollout correction that asynchronous runs get by default (tis)."""

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


@pytest.mark.timeout(1300)
def test_opd_recipe_in_asynchronous_sidecar_mode(tiny_models, task_files, tmp_path):
    etcd = EtcdProcess(tmp_path / "etcd")
    etcd.start()
    try:
        runs = [{"name": "opd", "recipe": "opd", "overrides": tiny_overrides(
            tiny_models["qwen2"], task_files, tmp_path / "opd", fp32=False, **{
                "teacher.path": tiny_models["llama"], "rollout.mode": "sidecar", "sidecar.etcd": etcd.endpoint,
                "sidecar.port": free_port(), "rollout.kv_cache_gb": 0.125, "rollout.max_staleness": 1,
                "data.val_files": "[]"})}]
        result = run_torchrun(WORKER, json.dumps(runs), tmp_path=tmp_path, timeout=1200)
    finally:
        etcd.stop()
    assert result["opd"]["ok"], result["opd"].get("error")
    steps = {d["step"]: d for d in map(json.loads, (tmp_path / "opd" / "metrics.jsonl").read_text().splitlines())
             if "opd/reverse_kl" in d}
    assert set(steps) == {1, 2}, sorted(steps)
    for m in steps.values():
        assert math.isfinite(m["opd/reverse_kl"]) and m["opd/reverse_kl"] != 0, m
        assert m["actor/grad_norm"] > 0 and "timing/teacher_s" in m, m  # no reward: the teacher alone trains it
        assert "async/staleness_tokens_mean" in m  # asynchronous: the tokens carry the versions that sampled them
