"""Reclaim what a vLLM server's processes left in /dev/shm when they were killed (and nothing else).

vLLM's API server, engine core and workers create POSIX shared memory: Python multiprocessing's named
semaphores (`sem.mp-*`) and shared-memory blocks (`psm_*`, vLLM's message queues, 160-240 MiB each),
and on CPU with TP > 1 the all-reduce segments (`*cpushm*`). Their owners remove them on a clean exit
(through multiprocessing's resource tracker, itself a process of the server's group); a SIGKILL, a
server that dies while starting, or our own SIGKILL of its stragglers leaves them behind.

So the supervisor records, while its server lives (at start-up, from the watchdog, before each stop),
the files of those kinds that the processes of the server's process group map and that appeared after
the server was spawned; after the group is gone it removes those that no live process maps. Files are
matched by inode, not by the name in `/proc/<pid>/maps`: glibc's `sem_open` maps a temporary file and
links it to the semaphore's name, so the maps show the temporary name, deleted. Files of
other jobs are never candidates: they are neither mapped by this server's processes nor new since its
spawn. The rings of the checkpoint engine are never candidates either (other names, and mapped by the
trainer or the pod's receiver).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from hybrid_rl.utils.shm import SHM_DIR
from hybrid_rl.weightsync.vllm_compat import CPU_SHM_MARKER

log = logging.getLogger(__name__)


def group_pids(pgid: int) -> list[str]:
    """The live processes of process group `pgid` (the server was started in a session of its own)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            pids.append(p.name)
    return pids


def mapped_inodes(pids: list[str] | None, shm_dir: Path = SHM_DIR) -> set[int]:
    """Inodes of the files under `shm_dir` that the given processes (None: every readable one) map."""
    prefix, inodes = f"{shm_dir}/", set()
    for pid in pids if pids is not None else [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith(prefix):
                        inodes.add(int(parts[4]))
        except (OSError, ValueError):
            continue
    return inodes


def unmapped(paths, shm_dir: Path = SHM_DIR) -> list[str]:
    """Those of `paths` (files under `shm_dir`) that still exist and that no live process maps, sorted."""
    in_use, out = mapped_inodes(None, shm_dir), []
    for path in sorted(paths):
        try:
            if os.stat(path).st_ino not in in_use:
                out.append(path)
        except OSError:
            continue
    return out


def reclaimable(name: str) -> bool:
    return name.startswith(("sem.mp-", "psm_")) or CPU_SHM_MARKER in name


class ShmReclaimer:
    def __init__(self, shm_dir: Path = SHM_DIR):
        self.shm_dir = Path(shm_dir)
        self.pgid: int | None = None
        self.since = 0.0
        self.seen: set[str] = set()
        self._lock = threading.Lock()  # the supervisor's watchdog scans while its owner may stop the server

    def started(self, pgid: int) -> None:
        self.pgid, self.since = pgid, time.time() - 1.0  # file times have a coarse clock

    def scan(self) -> None:
        """Record the reclaimable files the group maps now (cheap: the group's maps only)."""
        if self.pgid is None:
            return
        inodes = mapped_inodes(group_pids(self.pgid), self.shm_dir)
        if not inodes:
            return
        try:
            entries = list(os.scandir(self.shm_dir))
        except OSError:
            return
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_ino in inodes and reclaimable(e.name) and st.st_ctime >= self.since:
                with self._lock:
                    self.seen.add(e.path)

    def reclaim(self) -> list[str]:
        """After the group is gone: remove what it recorded that no live process maps; returns the removed files."""
        with self._lock:
            left = {p for p in self.seen if os.path.exists(p)}
            self.seen = set()
        if not left:
            return []
        removed = []
        for path in unmapped(left, self.shm_dir):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                continue
        if removed:
            log.info("removed %d shared-memory files left by the stopped vLLM server (%s, ...)", len(removed),
                     Path(removed[0]).name)
        return removed
