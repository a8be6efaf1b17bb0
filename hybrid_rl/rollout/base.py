"""The rollout interface: what the trainer generates with, whatever the deployment behind it.

`rollout.mode` picks the implementation (`build.DEPLOYMENTS`, the registry of deployments); the trainer only
ever calls these methods, so a new deployment is a new class here, not a branch in the trainer:

* ``colocated`` (`sampler.Sampler`): vLLM in-process on the training ranks (the hybrid engine); a
  session switches every rank into rollout mode (offload train state, sync weights) and back.
* ``sidecar`` (`sidecar.SidecarRollout`): vLLM server processes beside the trainer, fed by the checkpoint
  engine. It also streams (`StreamingRollout`): requests sent now, results collected later, while the
  trainer trains, which is what asynchronous training (`experience/buffered.py`) is built on.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from hybrid_rl.data import PromptRecord
from hybrid_rl.errors import RolloutError  # noqa: F401 - raised here; its home is hybrid_rl.errors
from hybrid_rl.types import Generation, Request, Rollout


@dataclass(frozen=True)
class SyncReport:
    """What the last session's weight update cost: seconds syncing, seconds switching modes, bytes per rank."""

    sync_s: float = 0.0
    switch_s: float = 0.0
    bytes_per_rank: int = 0


@dataclass(frozen=True)
class Arrival:
    """One streamed request's response, with the policy version that sampled each of its tokens."""

    generation: Generation
    token_versions: torch.Tensor  # [response tokens] int64
    # multi-turn trajectories (`agentic_sidecar.py`): the loss mask over the response (empty: every token), reward
    # fields to add to the row's (the tool calls), a tool's infrastructure failure (the sample is then excluded),
    # and the trajectory's counts for the metrics
    loss_mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    fields: Mapping[str, Any] = field(default_factory=dict)
    infra_failed: bool = False
    stats: Mapping[str, float] = field(default_factory=dict)
    prompt_ids: tuple[int, ...] = ()  # the trajectory's own prompt (an agent's first call's, an environment's); () the row's
    # black-box agents: the episode's stitched trajectories before this one, in call order (their own generation,
    # versions, mask and prompt; `fields`, `stats` and `infra_failed` are this arrival's). Every one is trained; this
    # last one is what the reward functions judge, and its reward is the whole episode's
    earlier: tuple[Arrival, ...] = ()


class RolloutWorker(Protocol):
    def session(self, version: int | None = None) -> AbstractContextManager[object]:
        """The body may call `generate`; entering brings the current weights to the generator. Collective.

        `version`: the policy version (optimizer steps taken) of those weights; a generator that already holds
        it may skip the update. None: update in any case.
        """

    def generate(self, records: list[PromptRecord], *, n: int, step: int, group_base: int,
                 greedy: bool = False) -> Rollout:
        """`n` responses per record (the same records on every rank), inside a session. Collective."""

    def last_sync(self) -> SyncReport:
        """The weight update of the last session entered."""

    def keep_room_for(self, optimizer: torch.optim.Optimizer, offload: str) -> None:
        """Another optimizer (the critic's) whose state stays on the device through rollouts unless `offload` moves
        it: a generator sharing the trainer's GPUs sizes its memory share with room for the state still to come."""

    def close(self) -> None:
        """Stop the generator (before the process group goes)."""


@runtime_checkable
class StreamingRollout(RolloutWorker, Protocol):
    """A rollout worker whose requests can stay in flight while the trainer trains (between sessions too).

    Sessions still bring new weights: requests in flight are paused meanwhile and continue under the new
    weights, and each response says which version sampled each token.
    """

    def submit(self, requests: list[Request], *, greedy: bool = False) -> None:
        """Send this rank's requests (keys are the caller's) and return at once. Collective, inside a session."""

    def arrivals(self) -> tuple[dict[int, Arrival], dict[int, str]]:
        """(responses by key, errors by key) of this rank's requests that ended since the last call. Local."""

    def in_flight(self) -> int:
        """This rank's requests sent and not ended."""

    def recover(self) -> None:
        """After failed requests: bring the generators back (restart, update again). Collective, in a session."""


def agent_row(record: PromptRecord) -> dict:
    """What a black-box agent is given: the row's columns and its prompt as rendered (`data.prompt_key`)."""
    return {**record.fields, "prompt_text": record.prompt_text}


def row_fields(row: Mapping[str, Any] | None) -> dict:
    """The dataset row's own columns back from an `agent_row` (what an environment's `reset` gets, as colocated)."""
    return {k: v for k, v in (row or {}).items() if k != "prompt_text"}


def prompt_of(a: Arrival) -> torch.Tensor | None:
    """The sample's prompt: its own (a black-box agent's first call, an environment's), else (None) the row's."""
    return torch.tensor(a.prompt_ids, dtype=torch.int64) if a.prompt_ids else None
