"""What runs inside a reward worker process, and the progress board the parent reads.

Each worker owns one slot of a shared array: (its pid, the index of the sample it is scoring, when it
started; index -1 and time 0.0 when idle). The parent reads the board to find a sample stuck past the
hard limit, and so knows exactly which sample to count as a timeout; and, when a worker dies, which
sample it died on. ``time.monotonic`` is system-wide on Linux, so the start times compare across
processes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybrid_rl.rewards.rubric import Rubric, SampleScore

__all__ = ["BoardRow", "board_rows", "init_worker", "new_board", "ready", "score_chunk", "stuck_samples"]

_FIELDS = 3  # pid, sample index, start time


@dataclass(frozen=True)
class BoardRow:
    pid: int
    index: int  # -1: idle
    started: float


def new_board(ctx: Any, num_workers: int) -> Any:
    return ctx.Array("d", [0.0, -1.0, 0.0] * num_workers)

_rubric: Rubric | None = None
_board: Any = None
_slot = -1


def init_worker(rubric: Rubric, board: Any, next_slot: Any) -> None:
    """Worker initialiser: keep the rubric, take a progress slot, load what the rewards need."""
    global _rubric, _board, _slot
    _rubric, _board = rubric, board
    with next_slot.get_lock():
        _slot = next_slot.value
        next_slot.value += 1
    if 0 <= _slot < len(board) // _FIELDS:
        with board.get_lock():
            board[_FIELDS * _slot] = os.getpid()
    _exit_with_parent()
    rubric.warmup()


def _exit_with_parent(period_s: float = 1.0) -> None:
    """Leave when the trainer rank that started this worker is gone (even SIGKILLed: no one tells us).

    Otherwise an orphaned worker lives on, holding the job's output pipes open.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def ready() -> int:
    return os.getpid()


def _mark(index: int, started: float) -> None:
    if 0 <= _slot < len(_board) // _FIELDS:
        with _board.get_lock():
            _board[_FIELDS * _slot + 1], _board[_FIELDS * _slot + 2] = index, started


def score_chunk(chunk: list[tuple[int, str, Mapping[str, Any]]]) -> list[SampleScore]:
    assert _rubric is not None, "worker initialiser did not run"
    scores = []
    for index, response, sample in chunk:
        _mark(index, time.monotonic())
        scores.append(_rubric.score_sample(index, response, sample))
    _mark(-1, 0.0)
    return scores


def board_rows(board: Any) -> list[BoardRow]:
    """What each worker is doing (parent side); [] if the lock cannot be had within a second.

    A worker killed from outside (the OOM killer, say) inside ``_mark`` never releases the lock: do not
    hang on it. The death breaks the pool, which is then replaced with a fresh board.
    """
    lock = board.get_lock()
    if not lock.acquire(timeout=1.0):
        return []
    try:
        values = list(board)
    finally:
        lock.release()
    return [BoardRow(int(values[i]), int(values[i + 1]), values[i + 2]) for i in range(0, len(values), _FIELDS)]


def stuck_samples(board: Any, limit_s: float) -> list[int]:
    """Indices of samples some worker has been scoring for longer than ``limit_s`` (parent side)."""
    now = time.monotonic()
    return [row.index for row in board_rows(board) if row.started > 0 and now - row.started > limit_s]
