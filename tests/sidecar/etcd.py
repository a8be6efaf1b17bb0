"""An etcd that any process of a test may stop or restart: the sidecar fault test's worker stops the etcd the test
started and starts another on the same ports (in the worker's process), which the test then stops. Its pid is kept
in `<data_dir>.pid`. (The library's `EtcdProcess` stops only the server it started itself.)"""

from __future__ import annotations

import os
import signal
import time

from hybrid_rl.sidecar.etcd_server import EtcdProcess


class SharedEtcd(EtcdProcess):
    @property
    def pid_file(self):
        return self.data_dir.with_suffix(".pid")

    def start(self, timeout_s: float = 30.0) -> None:
        super().start(timeout_s)
        self.pid_file.write_text(str(self.proc.pid))

    def stop(self) -> None:
        """Stop the server this data folder's pid file names (started by this process or another)."""
        if (self.proc is None or self.proc.poll() is not None) and self.pid_file.exists():
            _stop_pid(int(self.pid_file.read_text()))
        super().stop()
        self.pid_file.unlink(missing_ok=True)


def _stop_pid(pid: int) -> None:
    """SIGTERM, then SIGKILL after 10 s, to a process this one did not start itself."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
