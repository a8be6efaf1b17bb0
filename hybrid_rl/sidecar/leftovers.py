"""What a SIGKILLed run leaves behind, found and removed by the next start: rings in /dev/shm, orphaned servers.

* Rings (`shm_ring.py`, 768 MiB per server TP rank by default) stay in /dev/shm until reboot when their
  writer is killed. Each ring has an `-owner` file naming its writer (pid and the process's start time,
  so a reused pid is not mistaken for it). A writer's first ring sweeps this user's `hrl-*` rings whose
  writer is gone and whose files no live process maps (a live run's ring is mapped by its writer and its
  server); rings without an owner file are not this code's to judge and are left alone.
* A server whose trainer was killed where the parent-death signal did not reach it (its pidfile beside
  its log, `<log>.pid`: pid, start time) is stopped by the next start of the same server (same log path).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

from hybrid_rl.sidecar.shm_reclaim import mapped_inodes
from hybrid_rl.utils.shm import SHM_DIR

log = logging.getLogger(__name__)
RING_PREFIX = "hrl-"


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (`/proc/<pid>/stat` field 22), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def identity(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid} {start_time(pid)}"


def alive(ident: str) -> bool:
    """Whether the process `identity` named is still the same live process."""
    try:
        pid, started = ident.split()
        return start_time(int(pid)) == started
    except ValueError:
        return False


def sweep_rings(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove this user's rings whose writer is dead and that no live process maps; returns the files removed."""
    removed: list[Path] = []
    mapped = None
    for owner in sorted(shm_dir.glob(f"{RING_PREFIX}*-owner")):
        try:
            st = os.lstat(owner)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077 or alive(owner.read_text().strip()):
                continue
        except OSError:
            continue
        base = owner.name[:-len("-owner")]
        files = [p for p in shm_dir.glob(f"{base}-*") if os.lstat(p).st_uid == os.geteuid()]
        if mapped is None:
            mapped = mapped_inodes(None, shm_dir)
        if any(os.lstat(p).st_ino in mapped for p in files):
            continue  # its server (or anyone) still maps it: not ours to take
        for p in files:
            p.unlink(missing_ok=True)
            removed.append(p)
    if removed:
        log.warning("removed %d shared-memory ring files of killed runs from %s: %s", len(removed), shm_dir,
                    ", ".join(sorted({p.name.rsplit("-", 1)[0] for p in removed})))
    return removed


# -- servers ---------------------------------------------------------------------------------------


def pidfile_of(log_path: str | Path) -> Path:
    return Path(f"{log_path}.pid")


def write_pidfile(path: Path, pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, identity(pid).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def stop_orphan(path: Path, timeout_s: float = 30.0) -> bool:
    """Stop the process group a previous start recorded in `path` if that process still runs; True if it did."""
    try:
        ident = path.read_text().strip()
    except OSError:
        return False
    path.unlink(missing_ok=True)
    if not alive(ident):
        return False
    pid = int(ident.split()[0])
    log.warning("a vLLM server of an earlier start (pid %d, %s) still runs: its trainer was killed; stopping it",
                pid, path)
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return True
        deadline = time.monotonic() + wait_s
        while alive(ident) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not alive(ident):
            return True
    return True


def sweep_private_etcd(folder: Path) -> list[Path]:
    """Remove the data folders (`etcd-private-<pid>`) of private etcds whose run (that pid) is gone."""
    removed = []
    for data in Path(folder).glob("etcd-private-*"):
        pid = data.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and start_time(int(pid)) is None and data.is_dir():
            shutil.rmtree(data, ignore_errors=True)
            data.with_suffix(".log").unlink(missing_ok=True)
            removed.append(data)
    if removed:
        log.warning("removed the private etcd data of killed runs: %s", ", ".join(map(str, removed)))
    return removed
