"""Which ranks share a checkpoint filesystem: one shared disk (a node, NFS, Lustre) or one per node.

A multi-node run without a shared filesystem gives every node its own `trainer.output_dir` (node-local disks):
then no rank can check, publish or prune another node's files, and each node's copy of a checkpoint holds its
own ranks' files. The ranks find out which of them see the same folder by each creating a uniquely named file
in it and looking up everyone else's (a lookup by a new name, never a cached directory listing, so NFS's
attribute cache cannot hide a file). The lowest rank of each group of ranks that see each other's files is that
filesystem's *leader*: it prepares, commits and prunes there; the ranks agree on everything else through the
process group.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from hybrid_rl.checkpoint.collective import (
    CAUGHT,
    CheckpointError,
    broadcast_from_rank0,
    is_distributed,
    raise_if_any_failed,
)
from hybrid_rl.distributed import collectives


@dataclass(frozen=True)
class Site:
    """This rank's view: the ranks whose files it sees under the checkpoint root (itself included), sorted."""

    ranks: tuple[int, ...]
    world: int

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def shared(self) -> bool:
        """Every rank sees the same filesystem (the one-node or NFS case)."""
        return len(self.ranks) == self.world


def find_site(root: Path, *, rank: int, world: int) -> Site:
    """Collective: the ranks that see this rank's `root` (created if missing). Raises CheckpointError on every
    rank if `root` cannot be written somewhere or if the ranks' views disagree (rank a sees b's file, b not a's)."""
    if not is_distributed(world):
        return Site((0,), 1)
    token = broadcast_from_rank0(uuid.uuid4().hex if rank == 0 else None, world=world)
    probe = root / f".site-{token}.rank{rank}"
    error = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
    except CAUGHT as e:
        error = e
    raise_if_any_failed(error, rank=rank, world=world, what="checking who shares the checkpoint folder", path=root)
    seen = tuple(r for r in range(world) if (root / f".site-{token}.rank{r}").exists())
    views = collectives.all_gather_object(seen)  # everyone has looked before anyone deletes its probe
    probe.unlink(missing_ok=True)
    for r, view in enumerate(views):
        if any(views[other] != view for other in view):
            raise CheckpointError(f"the ranks disagree about who shares {root}: rank {r} sees the files of ranks "
                                  f"{list(view)}, but they see {[list(views[o]) for o in view]}; give each node its "
                                  "own trainer.output_dir, or one filesystem that every node mounts")
    return Site(views[rank], world)
