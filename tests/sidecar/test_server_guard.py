"""A real vLLM sidecar server refuses every request without the run's token, and a weight-transfer namespace other
than the one it was started with; the token is on no command line. (One server start, random weights.)"""

import sys
from pathlib import Path

import pytest
import requests

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.sidecar.auth import auth_headers, run_secret, server_token
from hybrid_rl.sidecar.vllm_server import ServerSpec, VLLMServer

pytestmark = pytest.mark.slow

# The control paths a stranger would use (vLLM's RL and dev-mode endpoints, runtime LoRA, generation, metrics)
CONTROL = [("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
           ("POST", "/finish_weight_update"), ("POST", "/update_weight_version"), ("GET", "/weight_info"),
           ("POST", "/collective_rpc"), ("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("POST", "/pause"),
           ("POST", "/resume"), ("POST", "/reset_prefix_cache"), ("POST", "/v1/load_lora_adapter"),
           ("POST", "/v1/unload_lora_adapter"), ("POST", "/inference/v1/generate"), ("POST", "/v1/completions"),
           ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/openapi.json"),
           ("GET", "/docs"), ("GET", "/no-such-path")]
NAMESPACE = "hrl-test-guard-pinned"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("guard") / "server.log"
    s = VLLMServer(ServerSpec(model_path=tiny_models["qwen2"], tp=1, dtype="float32", port=free_port(),
                              max_model_len=256, seed=0, enforce_eager=True, log_path=str(log), python=sys.executable,
                              kv_cache_gb=0.125, max_lora_rank=8, namespace=NAMESPACE))
    try:
        s.start(timeout_s=300)
        yield s
    finally:
        s.stop()


def test_every_path_needs_the_runs_token(server):
    with_token = requests.get(f"{server.url}/openapi.json", headers=auth_headers(), timeout=30)
    assert with_token.status_code == 200
    paths = {p for p in with_token.json()["paths"] if "{" not in p}
    assert {"/init_weight_transfer_engine", "/collective_rpc", "/update_weight_version"} <= paths, sorted(paths)
    calls = set(CONTROL) | {("GET", p) for p in paths} | {("POST", p) for p in paths}
    wrong = {"Authorization": "Bearer " + "0" * 64}
    for method, path in sorted(calls):
        for headers in ({}, wrong, {"Authorization": server_token()}):  # none, a wrong one, the right one unmarked
            r = requests.request(method, f"{server.url}{path}", json={}, headers=headers, timeout=30)
            assert r.status_code == 401, f"{method} {path} with {headers}: {r.status_code} {r.text[:200]}"
    assert server.healthy() and isinstance(server.weight_version(), str)  # the project's own client sends it
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode(errors="replace")
    assert server_token() not in cmdline and run_secret() not in cmdline, "the token is on no command line"
    environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().decode(errors="replace")
    assert run_secret() not in environ, "the server holds its token, not the run's signing secret"


def test_the_weight_transfer_namespace_is_the_one_the_server_started_with(server):
    r = requests.post(f"{server.url}/init_weight_transfer_engine", headers=auth_headers(), timeout=60,
                      json={"init_info": {"namespace": "hrl-someone-elses-rings", "timeout_s": 5}})
    assert r.status_code != 200 and "refused" in server.log_tail(200), r.text[:500]
    # The pinned namespace passes the check (and then fails only because no writer made its ring here)
    r = requests.post(f"{server.url}/init_weight_transfer_engine", headers=auth_headers(), timeout=60,
                      json={"init_info": {"namespace": NAMESPACE, "timeout_s": 5}})
    assert r.status_code != 200 and "No such file" in server.log_tail(200) and server.healthy()
