"""Agreement between ranks: every rank reaches the same verdict, so none is left waiting in a collective.

A failure seen by one rank (its disk filled up) has to become the same `CheckpointError` on every
rank *before* anyone takes the next collective step; otherwise the healthy ranks sit in a barrier
for a rank that has already raised, until the process-group timeout (30 minutes by default).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from hybrid_rl.distributed import collectives
from hybrid_rl.errors import CheckpointError  # noqa: F401 - raised here; its home is hybrid_rl.errors

# DCP reports failures as CheckpointException, which derives from BaseException, not Exception.
CAUGHT = (Exception, CheckpointException)


def is_distributed(world: int) -> bool:
    return world > 1 and dist.is_available() and dist.is_initialized()


def describe(exc: BaseException, *, rank: int) -> str:
    """'rank r: OSError: ...' without tracebacks. DCP's exception already holds every failing rank's
    error (the same on all ranks), so it is unwrapped into those instead of being blamed on `rank`."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {_one_line(e)}" for r, (e, _) in sorted(exc.failures.items()))
    return f"rank {rank}: {_one_line(exc)}"


def _one_line(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def gather_errors(error: str | None, *, world: int) -> dict[int, str]:
    """Every rank's local error (None on success), seen identically on all ranks: {rank: error}."""
    if not is_distributed(world):
        return {0: error} if error else {}
    return {r: e for r, e in enumerate(collectives.all_gather_object(error)) if e is not None}


def raise_if_any_failed(error: BaseException | None, *, rank: int, world: int, what: str, path: Path) -> None:
    """Collective: if any rank hit an error, raise one CheckpointError naming `path` and every cause, on all ranks."""
    errors = gather_errors(None if error is None else describe(error, rank=rank), world=world)
    if errors:
        causes = "; ".join(dict.fromkeys(errors.values()))  # a DCP failure reads the same on every rank
        raise CheckpointError(f"{what} {path} failed: {causes}") from error


def broadcast_from_rank0(obj: Any, *, world: int) -> Any:
    """Rank 0's `obj` on every rank (a small picklable value: a path, a decision)."""
    if not is_distributed(world):
        return obj
    return collectives.broadcast_object(obj, src=0)


def decide_on_rank0(fn: Callable[[], Any], *, rank: int, world: int, what: str) -> Any:
    """Collective: rank 0 computes `fn()` and every rank gets the result; if it raises there, every
    rank raises CheckpointError (rather than rank 0 raising while the others wait in the broadcast)."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except CAUGHT as e:
            error = describe(e, rank=0)
    result, error = broadcast_from_rank0((result, error), world=world)
    if error is not None:
        raise CheckpointError(f"{what} failed: {error}")
    return result


def barrier(world: int) -> None:
    if is_distributed(world):
        collectives.barrier()
