"""One pod's vLLM sidecar under supervision: started from dummy weights, registered in etcd, restarted when it dies.

The registration (`<prefix>/servers/<pod>`: endpoint, TP size, loaded weight version) lives under a
lease that this process keeps alive, so a pod that dies drops out by itself. A watchdog thread checks
the server's `/health` every `health_every_s` seconds; when the process exited, or `HEALTH_MISSES`
checks in a row went unanswered (one slow answer from a busy server is not a death), the
registration's version goes to None, so no rank dispatches to a server that lost its weights. Restarting is done by the
owner (`ensure_running`), at a point where it can also bring the weights back: the trainer before an
update, a pod's receiver before it loads the next one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from hybrid_rl.sidecar.etcd import Etcd, Registration
from hybrid_rl.sidecar.vllm_server import ServerError, ServerSpec, VLLMServer

log = logging.getLogger(__name__)
HEALTH_MISSES = 3  # unanswered /health checks in a row before a running server is withdrawn


def server_key(pod: int, index: int = 0) -> str:
    """A pod runs one server per TP group of its trainer ranks (`index`); rollout-only pods run one."""
    return f"servers/pod{pod}" if index == 0 else f"servers/pod{pod}-{index}"


class Sidecar:
    def __init__(self, spec: ServerSpec, etcd: Etcd, pod: int, *, ttl_s: int, start_timeout_s: float,
                 health_every_s: float = 2.0, index: int = 0,
                 prepare: Callable[[ServerSpec, int], ServerSpec] | None = None):
        self.server, self.etcd, self.pod, self.index = VLLMServer(spec), etcd, pod, index
        self.ttl_s, self.start_timeout_s, self.health_every_s = ttl_s, start_timeout_s, health_every_s
        self.version: str | None = None
        self.registration: Registration | None = None
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        # Completes the spec just before the first start (CUDA: the measured memory share), given the device memory
        # the trainer will hold at every later rollout but does not hold yet (`state_to_come`, the rollout's).
        self.prepare = prepare
        self.state_to_come: Callable[[], int] = lambda: 0

    def info(self) -> dict:
        s = self.server.spec
        return {"url": self.server.url, "tp": s.tp, "version": self.version, "pod": self.pod, "index": self.index}

    def start(self, *, wait: bool = True) -> None:
        """Start the server (dummy weights, no version) and register it; `wait=False`: `ensure_running` waits."""
        self.version = None
        if self.prepare is not None:
            self.server.spec, self.prepare = self.prepare(self.server.spec, self.state_to_come()), None
        self.server.spawn()
        if wait:
            self.server.wait_ready(timeout_s=self.start_timeout_s)
        self.register()

    def register(self) -> None:
        """Publish the server in etcd (kept under a lease, watched); after a restart, its new state."""
        if self.registration is None:
            self.registration = Registration(self.etcd, server_key(self.pod, self.index), self.info(), ttl_s=self.ttl_s)
            self._watchdog = threading.Thread(target=self._watch, name="sidecar-watchdog", daemon=True)
            self._watchdog.start()
        else:
            self.registration.update(self.info())

    def ensure_running(self) -> bool:
        """Wait for a server still starting; restart one that died (from dummy weights). True when restarted."""
        if self.server.healthy():
            return False
        if self.server.starts == 0:  # started late on purpose (CUDA: once the trainer's models are placed)
            self.start()
            return False
        if self.server.running():
            try:
                self.server.wait_ready(timeout_s=self.start_timeout_s)
                return False
            except ServerError as e:
                log.warning("%s", e)
        log.warning("vLLM sidecar of pod %d at %s is down (exit code %s); restarting it from dummy weights",
                    self.pod, self.server.url, None if self.server.proc is None else self.server.proc.poll())
        self._mark(None)
        self.server.stop()
        self.start()
        return True

    def loaded(self, version: str) -> None:
        """The server now holds `version` (verified and stamped): published for the dispatchers."""
        self._mark(version)

    def withdraw(self) -> None:
        """The server's weights are not a version any more (a failed update): no requests until the next one."""
        self._mark(None)

    def _mark(self, version: str | None) -> None:
        self.version = version
        if self.registration is not None:
            self.registration.update(self.info())

    def _watch(self) -> None:
        misses = 0
        while not self._stop.wait(self.health_every_s):
            self.server.shm.scan()  # what its processes map, to reclaim if they are killed
            if self.version is None or self._stop.is_set():
                misses = 0
                continue
            # A dead process is withdrawn at once; a live one only after `HEALTH_MISSES` checks in a row go
            # unanswered (a server busy with a long batch can miss one 5 s /health).
            dead = not self.server.running()
            misses = 0 if not dead and self.server.healthy() else misses + 1
            if dead or misses >= HEALTH_MISSES:
                log.warning("vLLM sidecar of pod %d %s: withdrawn from dispatch", self.pod,
                            "exited" if dead else f"missed {misses} health checks in a row")
                try:
                    self._mark(None)
                except Exception as e:  # etcd away too: the dispatchers see the request failures instead
                    log.warning("could not withdraw the sidecar in etcd: %s", e)

    # -- memory between phases (CUDA sleep mode) ---------------------------------------------------

    def sleep(self, level: int) -> None:
        """Level 1: weights to host memory, KV cache dropped; level 2: both dropped (the next update reloads)."""
        self.server.post(f"/sleep?level={level}")
        if level == 2:
            self._mark(None)

    def wake_up(self) -> None:
        self.server.post("/wake_up")

    def close(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=10)
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        self.server.stop()
