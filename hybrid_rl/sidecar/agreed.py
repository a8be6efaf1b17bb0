"""Work done on some ranks whose outcome every rank must share: a failure there stops every rank alike instead of
leaving the others waiting in a collective."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from hybrid_rl.distributed.collectives import all_gather_object, broadcast_object
from hybrid_rl.errors import RolloutError

T = TypeVar("T")


def on_rank0(rank: int, what: str, fn: Callable[[], T]) -> T:
    """`fn()` on rank 0 (it owns the server and talks to etcd), its result or its error on every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(e).__name__}: {e}"
    result, error = broadcast_object((result, error))
    if error:
        raise RolloutError(f"{what} failed on rank 0: {error}")
    return result


def on_every_rank(rank: int, what: str, fn: Callable[[], T]) -> list[T]:
    """`fn()` on every rank (it acts on the leaders, which own a server; rank 0 also talks to etcd), the list of
    results on every rank, or the first error raised on every rank alike."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised on every rank below
        error = f"rank {rank}: {type(e).__name__}: {e}"
    results = all_gather_object((result, error))
    errors = [e for _, e in results if e]
    if errors:
        raise RolloutError(f"{what} failed on {errors[0]}")
    return [r for r, _ in results]
