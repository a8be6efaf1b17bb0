"""A private etcd server: on free ports, its data in a folder of its own; stopped (or restarted) at will.

Started by a one-pod sidecar run given no `sidecar.etcd` (`build.py`: stopped with the run, and with
the trainer if it dies: parent-death signal), by the demo, the benchmarks and the tests. Multi-pod runs
point `sidecar.etcd` at an etcd they run themselves."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import requests

from hybrid_rl.distributed.mesh import free_port


class EtcdProcess:
    """One etcd server process, started and stopped by this object."""

    def __init__(self, data_dir: Path, port: int = 0, peer_port: int = 0, *, die_with_parent: bool = False):
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian package etcd-server; `make install-sidecar` installs it)")
        self.binary, self.data_dir = binary, Path(data_dir)
        self.port, self.peer_port = port or free_port(), peer_port or free_port()
        self.proc: subprocess.Popen | None = None
        self.die_with_parent = die_with_parent  # SIGTERM when the process that started it dies (Linux `setpriv`)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        url, peer = self.endpoint, f"http://127.0.0.1:{self.peer_port}"
        log = open(self.data_dir.with_suffix(".log"), "ab")  # noqa: SIM115 - the child keeps it
        setpriv = shutil.which("setpriv") if self.die_with_parent else None
        if self.die_with_parent and setpriv is None:
            raise RuntimeError("`setpriv` (util-linux) is not installed: the private etcd could not be tied to the "
                               "run's life and would outlive a killed run; install util-linux")
        self.proc = subprocess.Popen(
            [*([setpriv, "--pdeathsig", "TERM"] if setpriv else []), self.binary, "--name", "test", "--data-dir", str(self.data_dir), "--listen-client-urls", url,
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

