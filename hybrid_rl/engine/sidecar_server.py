"""One pod's vLLM sidecar under supervision: started from dummy weights, registered in etcd, restarted when it dies.

The registration (`<prefix>/servers/<pod>`: endpoint, TP size, loaded weight version) lives under a
lease that this process keeps alive, so a pod that dies drops out by itself. A watchdog thread checks
the server's `/health` every `health_every_s` seconds; when it fails the registration's version goes
to None at once, so no rank dispatches to a server that lost its weights. Restarting is done by the
owner (`ensure_running`), at a point where it can also bring the weights back: the trainer before an
update, a pod's receiver before it loads the next one.
"""

from __future__ import annotations

import logging
import threading

from hybrid_rl.dist.etcd import Etcd, Registration
from hybrid_rl.engine.vllm_server import ServerError, ServerSpec, VLLMServer

log = logging.getLogger(__name__)


def server_key(pod: int) -> str:
    return f"servers/pod{pod}"


class Sidecar:
    def __init__(self, spec: ServerSpec, etcd: Etcd, pod: int, *, ttl_s: int, start_timeout_s: float,
                 health_every_s: float = 2.0):
        self.server, self.etcd, self.pod = VLLMServer(spec), etcd, pod
        self.ttl_s, self.start_timeout_s, self.health_every_s = ttl_s, start_timeout_s, health_every_s
        self.version: str | None = None
        self.registration: Registration | None = None
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    def info(self) -> dict:
        s = self.server.spec
        return {"url": self.server.url, "tp": s.tp, "version": self.version, "pod": self.pod}

    def start(self, *, wait: bool = True) -> None:
        """Start the server (dummy weights, no version) and register it; `wait=False`: `ensure_running` waits."""
        self.version = None
        self.server.spawn()
        if wait:
            self.server.wait_ready(timeout_s=self.start_timeout_s)
        if self.registration is None:
            self.registration = Registration(self.etcd, server_key(self.pod), self.info(), ttl_s=self.ttl_s)
            self._watchdog = threading.Thread(target=self._watch, name="sidecar-watchdog", daemon=True)
            self._watchdog.start()
        else:
            self.registration.update(self.info())

    def ensure_running(self) -> bool:
        """Wait for a server still starting; restart one that died (from dummy weights). True when restarted."""
        if self.server.healthy():
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
        while not self._stop.wait(self.health_every_s):
            if self.version is not None and not self.server.healthy() and not self._stop.is_set():
                log.warning("vLLM sidecar of pod %d stopped answering /health: withdrawn from dispatch", self.pod)
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
