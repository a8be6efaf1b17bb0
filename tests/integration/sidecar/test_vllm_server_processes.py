"""The vLLM sidecar's checks before start (an interpreter probed in a subprocess) and the reclaim of a killed
server's shared memory (a real process group, SIGKILLed)."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.sidecar.auth import SECRET_ENV
from hybrid_rl.sidecar.shm_reclaim import ShmReclaimer
from hybrid_rl.sidecar.vllm_server import ServerError, VLLMServer, check_python, port_free
from tests.unit.sidecar.test_vllm_server import _spec


def test_checks_before_start():
    check_python(sys.executable)
    with pytest.raises(ServerError, match="no such interpreter"):
        check_python("/nonexistent/python")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert not port_free("127.0.0.1", s.getsockname()[1])


def test_a_killed_servers_shared_memory_is_reclaimed_and_nothing_else(tmp_path):
    """A process group that creates multiprocessing semaphores and shared memory (as vLLM's processes do) is
    SIGKILLed: the reclaimer removes what the group mapped, keeps a file it did not create and one still mapped."""
    foreign = Path("/dev/shm") / f"psm_foreign_{os.getpid()}"
    foreign.write_bytes(b"x")
    code = ("import multiprocessing as mp, sys, time\n"
            "from multiprocessing import shared_memory\n"
            "ctx = mp.get_context('spawn'); s = ctx.Semaphore(1)\n"
            "m = shared_memory.SharedMemory(create=True, size=4096)\n"
            "print(m.name, flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        name = proc.stdout.readline().strip()
        rec = ShmReclaimer()
        rec.started(proc.pid)
        rec.scan()
        assert f"/dev/shm/{name}" in rec.seen and any("/sem.mp-" in p for p in rec.seen), rec.seen
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        left = [p for p in rec.seen]
        assert all(os.path.exists(p) for p in left)  # a SIGKILL leaves them
        removed = rec.reclaim()
        assert sorted(removed) == sorted(left) and not any(os.path.exists(p) for p in left)
        assert foreign.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        foreign.unlink(missing_ok=True)


def test_a_server_reachable_from_other_machines_needs_the_run_secret(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    server = VLLMServer(_spec(host="192.0.2.2", port=1, log_path=str(tmp_path / "s.log")))
    with pytest.raises(ServerError, match="sidecar.host=192.0.2.2 is reachable from other machines.*no run secret"):
        server.spawn()
    assert server.proc is None and not (tmp_path / "s.log").exists()
