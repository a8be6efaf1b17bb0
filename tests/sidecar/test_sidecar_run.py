"""Sidecar mode end to end: real vLLM server processes, real etcd, real shared memory, two pods on one machine.

One run (to share the servers' start-up): GRPO for two steps on 2 trainer ranks with the pod's own
server, plus a simulated second pod (`python -m hybrid_rl.pod`: its own server and shared-memory
namespace) that receives every update through the pod group's broadcast. Before step 2 the pod's
server is killed with SIGKILL and etcd is stopped for 6 s. After each step the servers' greedy
generations must equal Hugging Face's on the trainer's full weights, and the sampled tokens' log-probs the
trainer's (fp32). The model ties its word embeddings, as the small models users start with do.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.build import sidecar_namespace
from hybrid_rl.config import load_config
from hybrid_rl.dist.etcd_server import EtcdProcess
from hybrid_rl.dist.mesh import free_port
from tests.conftest import REPO, run_torchrun
from tests.e2e.conftest import tiny_overrides

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "run_sidecar.py"


def test_grpo_in_sidecar_mode_with_a_second_pod_a_killed_server_and_an_etcd_restart(tiny_models, task_files,
                                                                                   tmp_path):
    etcd = EtcdProcess(tmp_path / "etcd")
    etcd.start()
    out = tmp_path / "run"
    # A model with tied word embeddings (as the small Qwen2.5 models): the servers' head must follow the embedding.
    overrides = tiny_overrides(tiny_models["qwen2_tied"], task_files, out, **{
        "rollout.mode": "sidecar", "sidecar.etcd": etcd.endpoint, "sidecar.port": free_port(), "sidecar.pods": 2,
        "sidecar.pod_wait_s": 600, "sidecar.etcd_wait_s": 120, "rollout.kv_cache_gb": 0.125,
        "data.val_prompts": 4})
    pod_log = open(tmp_path / "pod1.log", "w")  # noqa: SIM115
    pod = subprocess.Popen([sys.executable, "-m", "hybrid_rl.pod", "--config-name=grpo", *overrides, "sidecar.pod=1",
                            f"sidecar.port={free_port()}"], cwd=REPO, stdout=pod_log, stderr=subprocess.STDOUT,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        args = {"overrides": overrides, "etcd": {"dir": str(etcd.data_dir), "port": etcd.port,
                                                 "peer_port": etcd.peer_port}}
        r = run_torchrun(WORKER, json.dumps(args), nproc=2, tmp_path=tmp_path, timeout=900)
        pod.wait(120)  # the trainer's close tells the pod to stop
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()
        pod_log.close()
        etcd.stop()
    pod_out = (tmp_path / "pod1.log").read_text()
    assert pod.returncode == 0, pod_out[-3000:]
    for step, check in enumerate(r["steps"], start=1):
        assert len(check["servers"]) == 2, f"step {step}: both pods at the current version: {check['servers']}"
        assert check["vllm"] == check["hf"], f"step {step}: servers' greedy != HF on the trainer's weights"
        assert check["server_version"] == check["version"]
        assert check["loss_finite"]
        assert check["logprob_diff_max"] < 1e-3, f"step {step}: the servers' log-probs are not the trainer's"
    assert r["server_starts"] == 2, "the killed server was started again"
    assert any("unreachable" in w for w in r["warnings"]) and any("answers again" in w for w in r["warnings"]), \
        r["warnings"]
    assert "weights v" in pod_out and "loaded and verified" in pod_out
    cfg = load_config("grpo", overrides)
    for pod in (0, 1):
        assert not list(Path("/dev/shm").glob(sidecar_namespace(cfg, pod) + "-*")), "shared-memory rings removed"
