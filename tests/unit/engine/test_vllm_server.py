"""The vLLM sidecar's command line and the checks made before starting it (no server is started here)."""

import json
import socket
import sys

import pytest

from hybrid_rl.engine.completions import parse_choice, request_body
from hybrid_rl.engine.vllm_engine import Sampling
from hybrid_rl.engine.vllm_plugin import BACKEND
from hybrid_rl.engine.vllm_server import (
    SERVED_MODEL,
    ServerError,
    ServerSpec,
    _die_with_parent,
    check_python,
    port_free,
    server_command,
    server_env,
)


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
    env = server_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "X": "1"})
    assert env == {"X": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    wrapped = _die_with_parent(cmd)
    assert wrapped[-len(cmd):] == cmd and (wrapped == cmd or wrapped[1:3] == ["--pdeathsig", "TERM"])


def test_checks_before_start():
    check_python(sys.executable)
    with pytest.raises(ServerError, match="no such interpreter"):
        check_python("/nonexistent/python")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert not port_free("127.0.0.1", s.getsockname()[1])


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
