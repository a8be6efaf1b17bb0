"""A memory cgroup per sandbox run, where this process may make one: it bounds what no rlimit counts.

The rlimits bound each process's address space; the kernel memory a program makes the kernel hold for it (the
inodes and dentries of files in its tmpfs, page tables, socket buffers) is outside them, and bubblewrap cannot
cap a tmpfs's inode count. A memory cgroup counts all of it, and the tmpfs pages too. One is made as a child of
this process's own cgroup, when that is writable (root, or a delegated cgroup v2 subtree with the memory
controller); elsewhere `make` returns None and the sandbox runs without it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")
_PREFIX = "hybrid-rl-sandbox-"  # + the pid of the process that made it + a counter
_counter = itertools.count()
_swept: set[Path] = set()


class Cgroup:
    """One run's cgroup: processes started through `wrap(argv)` land in it; `close` removes it."""

    def __init__(self, path: Path, limit_file: str, peak_file: str):
        self.path, self.limit_file, self.peak_file = path, limit_file, peak_file

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run by a shell that first moves itself into the cgroup (its children are born there)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def peak(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / self.peak_file).read_text())
        return None

    def close(self) -> None:
        """Remove it (empty once the run's processes are gone; a moment's retry for the kernel to notice)."""
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


def _own(controller: str) -> tuple[Path, bool] | None:
    """This process's cgroup directory for `controller` and whether it is cgroup v2, or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controller in controllers.split(","):
            return _ROOT / controller / rel.lstrip("/"), False
    for line in lines:
        if line.startswith("0::") and (_ROOT / "cgroup.controllers").is_file():
            return _ROOT / line[3:].lstrip("/"), True
    return None


def make(limit_bytes: int) -> Cgroup | None:
    """A new memory cgroup capped at `limit_bytes` (swap included where the kernel lets us), or None."""
    own = _own("memory")
    if own is None:
        return None
    parent, v2 = own
    limit_file, peak_file = ("memory.max", "memory.peak") if v2 else ("memory.limit_in_bytes",
                                                                       "memory.max_usage_in_bytes")
    if parent not in _swept:
        sweep(parent)
        _swept.add(parent)
    path = parent / f"{_PREFIX}{os.getpid()}-{next(_counter)}"
    try:
        path.mkdir()
    except OSError:
        return None
    group = Cgroup(path, limit_file, peak_file)
    try:
        (path / limit_file).write_text(str(limit_bytes))
        for name in ("memory.swap.max", "memory.memsw.limit_in_bytes"):  # no escape into swap
            with contextlib.suppress(OSError):
                (path / name).write_text("0" if name.endswith("swap.max") else str(limit_bytes))
    except OSError:  # no memory controller there (a v2 subtree without it delegated)
        group.close()
        return None
    return group


def sweep(parent: Path) -> list[Path]:
    """Remove the cgroups left by processes that are gone (a reward worker killed mid-run never closed its run's);
    a cgroup still holding a process cannot be removed and is kept. Returns those removed."""
    removed = []
    for path in parent.glob(f"{_PREFIX}*-*"):
        pid = path.name[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                path.rmdir()
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
