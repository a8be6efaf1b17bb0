"""Shared memory between the ranks of one CPU host: segments every rank maps (`map_segments`, which FSDP's
collectives in `shm_comms` use too) and an all-to-all through them (`ShmExchange`, the weight sync's buckets).

Between two ranks of one host gloo's `all_to_all_single` goes through loopback TCP: at the 0.5B shape, 2 ranks
x 1 thread, the bytes each rank receives took 2.5x a `copy_` of them alone. Here every rank writes what it
sends into its own shared-memory slot, the ranks meet at a barrier, and each reads what it receives straight
from the senders' slots: the bytes cross once, by the receiver's own copy (the landing that reads them).

Each rank has two slots and writes them in turn (exchange j uses slot j % 2). Rank A writes slot j % 2 only after
the barrier of exchange j - 1, which rank B reaches only after it has finished reading exchange j - 2, the last
one in that slot; so a consumer must be done with exchange j's views before it starts exchange j + 1 (the
weight sync's row landing is: it lands each bucket before it asks for the next).

The files are unlinked as soon as every rank has mapped them: nothing stays in /dev/shm while the run lives or
after it ends (even killed); the memory is freed when the last process unmaps it.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid_rl.distributed.collectives import all_gather_object
from hybrid_rl.utils.shm import SHM_DIR, shm_free_bytes

log = logging.getLogger(__name__)

_ALIGN = 64  # segments and each slot's data start on a cache line


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a whole number of cache lines."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _host_key() -> str:
    """Equal for processes that can share memory through /dev/shm: one host (hostname and boot id) and one /dev/shm
    (its inode: containers on one host may each have their own)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}:{os.stat(SHM_DIR).st_ino if SHM_DIR.exists() else ''}"


def map_segments(sizes: list[int], count: int, group=None, *, what: str,
                 shm_dir: Path = SHM_DIR) -> list[list[torch.Tensor]] | None:
    """Collective: `count` shared-memory segments of `sizes[r]` bytes made by each rank r of `group` (0: none), each
    mapped by every rank: [rank][k] uint8 tensors. The files are unlinked before this returns.

    None on every rank, said once, where the ranks are not all on one host, /dev/shm lacks room for every segment
    (with a quarter to spare), or a rank could not make or map one: the caller keeps its collectives.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    keys = all_gather_object((_host_key(), shm_free_bytes(shm_dir)), group=group)
    need, least = count * sum(sizes), min(f for _, f in keys)
    if len({k for k, _ in keys}) != 1 or least < need * 1.25:
        if rank == 0:
            log.info("%s keeps the process group's collectives (%s)", what, "ranks on several hosts"
                     if len({k for k, _ in keys}) != 1 else f"/dev/shm has {least / 2**20:.0f} MiB free, shared "
                     f"memory would need {need / 2**20:.0f}")
        return None
    token = [uuid.uuid4().hex[:16] if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    paths = [[shm_dir / f"hybrid_rl-shm-{token[0]}-r{r}-s{k}" for k in range(count)] if sizes[r] else []
             for r in range(world)]
    error = None
    try:
        for p in paths[rank]:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                # Reserved now, not at first touch: a full /dev/shm then fails here (ENOSPC, every rank told) instead
                # of killing a rank with SIGBUS in the middle of a collective.
                os.posix_fallocate(fd, 0, sizes[rank])
            finally:
                os.close(fd)
    except OSError as e:
        error = f"rank {rank}: {e}"
    failed = [e for e in all_gather_object(error, group=group) if e]
    segments = None
    if not failed:
        try:
            segments = [[torch.from_file(str(p), shared=True, size=sizes[r], dtype=torch.uint8) for p in paths[r]]
                        for r in range(world)]
        except (OSError, RuntimeError) as e:
            error = f"rank {rank}: {e}"
        failed = [e for e in all_gather_object(error, group=group) if e]  # every rank has mapped every file (or failed)
    for p in paths[rank]:
        p.unlink(missing_ok=True)
    if failed:
        if rank == 0:
            log.warning("%s could not use shared memory (%s); it keeps the process group's collectives", what,
                        "; ".join(failed))
        return None
    return segments


class ShmExchange:
    """All-to-all of byte buffers between the ranks of `group`, through shared memory. Build with `create`."""

    def __init__(self, slots: list[list[torch.Tensor]], rank: int, world: int, slot_bytes: int, group) -> None:
        self._slots = slots  # [rank][0 or 1]: uint8, header then data
        self.rank, self.world, self.slot_bytes, self.group = rank, world, slot_bytes, group
        self._count = 0
        self._head = self.header_bytes(world)

    @staticmethod
    def header_bytes(world: int) -> int:
        """A slot's header: (offset, bytes) of each destination's part, as int64."""
        return aligned(world * 16)

    @classmethod
    def create(cls, slot_bytes: int, group=None, shm_dir: Path = SHM_DIR) -> ShmExchange | None:
        """Collective over `group`. None (every rank the same) where the ranks are not all on one host or /dev/shm
        has no room for two slots a rank: then the caller keeps its collective."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        slot_bytes = aligned(max(all_gather_object(slot_bytes, group=group)))  # every rank maps every slot at one size
        slots = map_segments([cls.header_bytes(world) + slot_bytes] * world, 2, group, what="the weight sync's exchange",
                             shm_dir=shm_dir)
        if slots is None:
            return None
        if rank == 0:
            log.info("weight sync: buckets move through shared memory (2 slots of %.1f MiB a rank)", slot_bytes / 2**20)
        return cls(slots, rank, world, slot_bytes, group)

    def send_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Where this rank writes the next exchange's send elements."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.slot_bytes:
            raise ValueError(f"a send of {nbytes} bytes exceeds the exchange's slot of {self.slot_bytes}")
        slot = self._slots[self.rank][self._count % 2]
        return slot[self._head : self._head + nbytes].view(dtype)

    def exchange(self, send: torch.Tensor, parts: list[tuple[int, int]], recv_splits: list[int]) -> list[torch.Tensor]:
        """Collective: `send` (from `send_buffer`) holds the part for rank d at elements [parts[d][0], + parts[d][1])
        (parts may coincide: ranks that receive the same bytes read them from one place); returns what each source
        rank sent to this one, as views of its slot (valid until the next exchange but one)."""
        k = self._count % 2
        self._count += 1
        elt = send.element_size()
        header = self._slots[self.rank][k][: self.world * 16].view(torch.int64)
        header.copy_(torch.tensor(parts, dtype=torch.int64).flatten() * elt)
        dist.barrier(group=self.group)
        out = []
        for s in range(self.world):
            start, nbytes = self._slots[s][k][: self.world * 16].view(torch.int64)[2 * self.rank : 2 * self.rank + 2].tolist()
            if nbytes != recv_splits[s] * elt:
                raise RuntimeError(f"rank {self.rank}: rank {s} sent {nbytes} bytes, {recv_splits[s] * elt} expected: "
                                   "the ranks' sync plans differ")
            out.append(self._slots[s][k][self._head + start : self._head + start + nbytes].view(send.dtype))
        return out
