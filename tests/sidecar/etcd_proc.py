"""A private etcd server for a test: on free ports, its data in a temporary folder; stopped (or restarted) at will."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import requests

from hybrid_rl.dist.mesh import free_port


class EtcdProcess:
    def __init__(self, data_dir: Path):
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian package etcd-server; `make install` installs it)")
        self.binary, self.data_dir = binary, Path(data_dir)
        self.port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        url, peer = self.endpoint, f"http://127.0.0.1:{self.peer_port}"
        log = open(self.data_dir.with_suffix(".log"), "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", str(self.data_dir), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/health", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.data_dir.with_suffix('.log')}")
            time.sleep(0.2)
        raise RuntimeError(f"etcd did not answer on {url} within {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
