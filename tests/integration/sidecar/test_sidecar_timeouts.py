"""Sidecar timeouts that mean what they say, against a real (tiny) HTTP server speaking the generate endpoint's
stream: a long response that keeps making progress succeeds, a stalled one fails after the progress timeout; a
server whose /health is slow once stays in dispatch, one that stays silent is withdrawn."""

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybrid_rl.sidecar.completions import CompletionClient, Router
from hybrid_rl.sidecar.sidecar_server import HEALTH_MISSES, Sidecar
from hybrid_rl.sidecar.vllm_server import ServerSpec
from hybrid_rl.types import Request, Sampling


class Behaviour:
    token_gap_s = 0.0  # between two streamed tokens
    stall_after = -1  # stop sending after this many tokens (-1: never)
    slow_health: list[float] = []  # the delays of the next /health answers (then prompt)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        if Behaviour.slow_health:
            time.sleep(Behaviour.slow_health.pop(0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_tokens"]
        assert body["stream"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(n):
            if i == Behaviour.stall_after:
                time.sleep(30)  # the client gives up long before
                return
            last = i == n - 1
            choice = {"index": 0, "token_ids": [100 + i], "logprobs": {"content": [{"token_id": 100 + i,
                                                                                     "logprob": -0.5}]},
                      "finish_reason": "length" if last else None,
                      "weight_versions": [{"version": "v1", "start": 0, "end": n}] if last else None}
            self._chunk(f"data: {json.dumps({'choices': [choice]})}\n\n")
            time.sleep(Behaviour.token_gap_s)
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    Behaviour.token_gap_s, Behaviour.stall_after, Behaviour.slow_health = 0.0, -1, []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _run(url: str, tokens: int, progress_s: float):
    client = CompletionClient(max_inflight=2, progress_timeout_s=progress_s)
    router = Router()
    router.set_servers([url])
    try:
        return client.run([Request(0, [1, 2], 0)], Sampling(max_tokens=tokens, temperature=1.0), router)
    finally:
        client.close()


def test_a_long_response_that_keeps_making_progress_is_not_timed_out(server):
    Behaviour.token_gap_s = 0.1
    t0 = time.monotonic()
    done, failed = _run(server, tokens=12, progress_s=0.6)  # 1.2 s in all, twice the progress timeout
    assert not failed and time.monotonic() - t0 > 1.0
    g = done[0]
    assert g.token_ids == tuple(range(100, 112)) and g.logprobs == (-0.5,) * 12
    assert g.finish_reason == "length" and g.weight_spans == (("v1", 0, 12),)


def test_a_request_that_stops_making_progress_fails_after_the_progress_timeout(server):
    Behaviour.stall_after = 3
    t0 = time.monotonic()
    done, failed = _run(server, tokens=12, progress_s=0.6)
    assert not done and "no token for" in failed[0] and "sidecar.progress_timeout_s" in failed[0]
    assert time.monotonic() - t0 < 5  # not the 30 s stall


def test_one_slow_health_check_keeps_a_server_in_dispatch_a_silent_one_is_withdrawn(server):
    port = int(server.rsplit(":", 1)[1])
    spec = ServerSpec(model_path="/m", tp=1, dtype="float32", port=port, max_model_len=64, seed=0,
                      enforce_eager=True, log_path="/dev/null", python=sys.executable)
    sidecar = Sidecar(spec, etcd=None, pod=0, ttl_s=5, start_timeout_s=5, health_every_s=0.1)
    sidecar.server.health_timeout_s = 1.0  # a prompt answer takes milliseconds, also on a loaded box
    # The process the watchdog watches (the HTTP side is the tiny server above): alive throughout.
    sidecar.server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sidecar.version = "v1"
        Behaviour.slow_health = [2.0] * (HEALTH_MISSES - 1)  # slow, but fewer times in a row than the limit
        watchdog = threading.Thread(target=sidecar._watch, daemon=True)
        watchdog.start()
        time.sleep(HEALTH_MISSES * 1.0 + 1.5)
        assert sidecar.version == "v1", "a server slow to answer /health a few times is kept"
        Behaviour.slow_health = [2.0] * 100  # silent from now on
        deadline = time.monotonic() + 15
        while sidecar.version is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sidecar.version is None, f"withdrawn after {HEALTH_MISSES} unanswered checks in a row"
    finally:
        sidecar._stop.set()
        Behaviour.slow_health = []
        sidecar.server.proc.kill()
        sidecar.server.proc.wait()
