"""What a SIGKILL leaves behind is removed by the next start, and nothing of a live run: real rings in /dev/shm made by
real processes, a real orphaned process group."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from hybrid_rl.sidecar import shm_ring
from hybrid_rl.sidecar.leftovers import alive, identity, pidfile_of, stop_orphan, sweep_private_etcd, write_pidfile
from hybrid_rl.sidecar.shm_ring import ShmRing
from hybrid_rl.utils.shm import SHM_DIR

HOLD = """
import sys, time
from hybrid_rl.sidecar.shm_ring import ShmRing
ring = ShmRing(sys.argv[1], 0, slots=2, slot_bytes=4096, create=sys.argv[2] == "write")
print("ready", flush=True)
time.sleep(600)
"""


def _hold(ns: str, role: str = "write") -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, ns, role], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture
def names():
    ns = {k: f"hrl-test-left-{k}-{uuid.uuid4().hex[:8]}" for k in ("dead", "live", "served", "new")}
    procs: list[subprocess.Popen] = []
    yield ns, procs
    for p in procs:
        p.kill()
        p.wait()
    for name in ns.values():
        for f in SHM_DIR.glob(name + "-*"):
            f.unlink()


def test_a_killed_writers_ring_is_swept_at_the_next_start_and_a_live_runs_is_kept(names):
    ns, procs = names
    dead = _hold(ns["dead"])
    procs.append(live := _hold(ns["live"]))
    served_writer = _hold(ns["served"])
    procs.append(_hold(ns["served"], "read"))  # its server still maps it: not to be taken from under it
    for p in (dead, served_writer):
        p.send_signal(signal.SIGKILL)
        p.wait()
    left = sorted(f.name for f in SHM_DIR.glob(ns["dead"] + "-*"))
    assert len(left) == 4, left  # ctl, two slots, owner: what the SIGKILL left
    shm_ring._swept.discard(SHM_DIR)  # a new process: its first ring sweeps
    ring = ShmRing(ns["new"], 0, slots=2, slot_bytes=4096, create=True)
    try:
        assert not list(SHM_DIR.glob(ns["dead"] + "-*")), "nothing of the killed run is left"
        assert len(list(SHM_DIR.glob(ns["live"] + "-*"))) == 4 and live.poll() is None, "a live run's ring is kept"
        assert len(list(SHM_DIR.glob(ns["served"] + "-*"))) == 4, "a ring a live process maps is kept"
    finally:
        ring.close()


def test_the_next_start_stops_a_server_its_killed_trainer_left_running(tmp_path):
    log = tmp_path / "vllm_server.log"
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        write_pidfile(pidfile_of(log), orphan.pid)
        assert alive(identity(orphan.pid))
        assert stop_orphan(pidfile_of(log)) is True
        deadline = time.monotonic() + 30
        while orphan.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert orphan.returncode == -signal.SIGTERM and not pidfile_of(log).exists()
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
    # A pidfile whose process is gone (or whose pid now names another process) stops nothing
    write_pidfile(pidfile_of(log), orphan.pid)
    assert stop_orphan(pidfile_of(log)) is False


def test_a_killed_runs_private_etcd_data_is_removed_and_a_live_ones_kept(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, live = tmp_path / f"etcd-private-{gone.pid}", tmp_path / f"etcd-private-{os.getppid()}"
    for d in (dead, live):
        (d / "member").mkdir(parents=True)
    assert sweep_private_etcd(tmp_path) == [dead]
    assert not dead.exists() and live.exists()
