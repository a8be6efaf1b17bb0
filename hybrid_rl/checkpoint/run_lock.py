"""One run per output folder: an exclusive lock, held for the run's life, so that two runs never share one.

Two runs in one folder destroy each other: each save removes the other's save in flight (`step_*.tmp`), pruning
keeps the newest steps of both, and a resume loads the other run's weights. So the run locks the folder with
`flock` before it writes anything there:

- rank 0 locks `run.lock`: a second run whose rank 0 uses this folder is refused (on any node whose filesystem
  passes `flock` on, which local disks and NFSv4 do);
- every node's first rank (LOCAL_RANK 0) locks `run.<host>.lock`: on node-local disks each node's folder is its
  own, and on a shared filesystem a second run on a node of this run is refused even where the filesystem keeps
  locks per client.

The kernel drops a `flock` when its holder exits, however it exits (SIGKILL included): no stale lock to clean up.
The holder writes its host and pid into the file, for the refusal to name.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from hybrid_rl.errors import InputError

RUN_LOCK = "run.lock"


class RunLocked(InputError):
    """Another run holds the output folder; the message names it (host, pid). Exit 2."""


def node_lock(host: str | None = None) -> str:
    return f"run.{host or socket.gethostname()}.lock"


@contextmanager
def hold_run_lock(output_dir: str | Path, *, rank: int, local_rank: int) -> Iterator[None]:
    """Hold this process's locks on `output_dir` (created, private, when missing) for the body; raise RunLocked
    at once when another run holds one (never waits)."""
    out = Path(output_dir)
    names = ([RUN_LOCK] if rank == 0 else []) + ([node_lock()] if local_rank == 0 else [])
    with ExitStack() as stack:
        if names:
            out.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name in names:
            stack.enter_context(_locked(out / name))
        yield


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise RunLocked(_refusal(path, fd)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host={socket.gethostname()} pid={os.getpid()} since={int(time.time())}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock (the file stays: removing it would race with the next run's open)


def _refusal(path: Path, fd: int) -> str:
    fields = dict(kv.split("=", 1) for kv in os.pread(fd, 512, 0).decode(errors="replace").split() if "=" in kv)
    host, pid = fields.get("host", "?"), fields.get("pid", "?")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(fields["since"]))) if "since" in fields else "?"
    gone = host == socket.gethostname() and pid.isdigit() and not Path(f"/proc/{pid}").exists()
    hint = (f" (pid {pid} has exited: a process it started still holds the lock, stop it)" if gone
            else "; wait for it to finish or give this run another trainer.output_dir")
    return f"output folder {path.parent} is in use by another run (host {host}, pid {pid}, since {since}){hint}"
