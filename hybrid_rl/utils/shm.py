"""Shared memory on Linux: where it lives, and which files live processes map."""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def shm_free_bytes(shm_dir: Path = SHM_DIR) -> int:
    """Bytes `shm_dir` has free (0 where there is no such directory)."""
    if not shm_dir.exists():
        return 0
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def mapped_paths(pids: list[str] | None = None) -> set[str]:
    """Files mapped by the given processes (default: every process whose maps this user can read)."""
    paths: set[str] = set()
    for pid in pids if pids is not None else [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]:
        try:
            with open(f"/proc/{pid}/maps") as f:
                paths.update(line.split(None, 5)[-1].strip() for line in f if line.count(" ") >= 5)
        except OSError:
            continue
    return paths
