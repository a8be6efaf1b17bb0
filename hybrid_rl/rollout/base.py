"""The rollout interface: what the trainer generates with, whatever the deployment behind it.

`rollout.mode` picks the implementation (`build.py`'s registry); the trainer only ever calls these
four methods, so a new deployment is a new class here, not a branch in the trainer:

* ``colocated`` (`sampler.Sampler`): vLLM in-process on the training ranks (the hybrid engine); a
  session switches every rank into rollout mode (offload train state, sync weights) and back.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from hybrid_rl.data import PromptRecord
from hybrid_rl.types import Rollout


class RolloutError(RuntimeError):
    """The rollout backend cannot go on (servers lost, coordination lost past its timeout): raised on every rank
    alike, so the run stops cleanly; the checkpoints written so far are intact."""


@dataclass(frozen=True)
class SyncReport:
    """What the last session's weight update cost: seconds syncing, seconds switching modes, bytes per rank."""

    sync_s: float = 0.0
    switch_s: float = 0.0
    bytes_per_rank: int = 0


class RolloutWorker(Protocol):
    def session(self) -> AbstractContextManager[object]:
        """The body may call `generate`; entering brings the current weights to the generator. Collective."""

    def generate(self, records: list[PromptRecord], *, n: int, step: int, group_base: int,
                 greedy: bool = False) -> Rollout:
        """`n` responses per record (the same records on every rank), inside a session. Collective."""

    def last_sync(self) -> SyncReport:
        """The weight update of the last session entered."""

    def close(self) -> None:
        """Stop the generator (before the process group goes)."""
