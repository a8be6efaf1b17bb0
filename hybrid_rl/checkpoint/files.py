"""Durable, atomic filesystem steps shared by checkpoint saves and HF exports.

"Durable" means fsynced: a rename is only atomic against a crash if the bytes it publishes (and the
directory entry itself) reached the disk first; otherwise a power loss can leave a committed but empty file.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (ENOSPC and EIO surface here, not later)."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def torch_bytes(obj: Any) -> bytes:
    """`torch.save` into memory: RNG states, scheduler state and other plain values, tensors included (read back as
    data only: `untrusted.read_state`)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (new files, renames) on POSIX filesystems."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file directly in `path`, then `path` itself (for files written by other libraries)."""
    for f in path.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(path)


def replace_dir(src: Path, dst: Path) -> None:
    """Publish the finished directory `src` as `dst` with a rename; an existing `dst` is replaced.

    A rename cannot overwrite a non-empty directory, so an old `dst` is first moved aside to a
    `*.tmp` name (which stale-directory cleanup removes if a crash strikes in between) and deleted
    after the new one is in place. If the rename fails, the old `dst` is put back.
    """
    old = dst.with_name(dst.name + ".replaced.tmp")
    had_old = dst.exists()
    if had_old:
        shutil.rmtree(old, ignore_errors=True)
        dst.rename(old)
    try:
        src.rename(dst)
    except OSError:
        if had_old:
            old.rename(dst)
        raise
    fsync_dir(dst.parent)
    if had_old:
        shutil.rmtree(old, ignore_errors=True)
