"""Where the trainer's next batch comes from: an experience source.

The trainer asks `next_batch(step)` once per step and gets the step's samples (each held by one rank),
their scores (or scores on their way) and the metrics of getting them. Two sources:

* `SyncSource`: generate the step's prompts now, with the weights of the step (the synchronous,
  on-policy loop; colocated mode, offline preference pairs). Dynamic sampling generates further rounds
  until enough groups have signal.
* `BufferedSource` (`buffered.py`): rollouts stream into an experience buffer while the trainer trains,
  at most `rollout.max_staleness` policy versions behind (sidecar mode).

Both are collective: every rank calls `next_batch` with the same step and gets the same batch index.
A source's state goes into the checkpoint (`state_dict` is the same on every rank; `rank_state` is this
rank's part: the samples it holds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybrid_rl.data import PromptLoader
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.errors import TrainingError  # noqa: F401 - raised here; its home is hybrid_rl.errors
from hybrid_rl.experience import dynamic
from hybrid_rl.experience.buffer import refill_seeds
from hybrid_rl.experience.scoring import Pending, Ready, Scorer
from hybrid_rl.rollout.base import RolloutWorker
from hybrid_rl.rollout.offline import preference_rollout
from hybrid_rl.types import Rollout, Scores
from hybrid_rl.utils.timer import PhaseTimer

Session = Callable[[int], AbstractContextManager[object]]  # policy version -> a rollout session bringing it


@dataclass
class Experience:
    """One step's samples, as the trainer's share and update stages take them."""

    rollout: Rollout
    scoring: Pending | Ready
    fields: dict[int, Mapping[str, Any]]  # record index -> the record's reward fields
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceSettings:
    n: int  # samples per prompt
    prompts_per_step: int
    dynamic_sampling: bool
    max_sampling_rounds: int
    offline_pairs: bool
    max_staleness: int
    seed: int
    max_restarts: int  # failed-request recoveries in a row before the run stops (sidecar.max_restarts)
    speculative: bool = False  # `rollout.speculative` on: drafted and accepted tokens go into the step's metrics


class ExperienceSource(Protocol):
    def next_batch(self, step: int) -> Experience:
        """The batch trained at `step` (its weights are the policy after step - 1 updates). Collective."""

    def state_dict(self) -> dict:
        """What every rank must agree on to resume (the same on every rank)."""

    def rank_state(self) -> dict:
        """This rank's part of the state (the samples it holds)."""

    def load_state_dict(self, state: dict, rank_state: dict) -> None:
        """Resume from `state_dict()` and this rank's `rank_state()` of a checkpoint."""


class SyncSource:
    """Generate each step's prompts when the step asks, with the step's weights."""

    def __init__(self, rollout: RolloutWorker, loader: PromptLoader, scorer: Scorer, dims: ParallelDims,
                 timer: PhaseTimer, session: Session, settings: SourceSettings):
        self.rollout, self.loader, self.scorer, self.dims = rollout, loader, scorer, dims
        self.timer, self.session, self.s = timer, session, settings

    def next_batch(self, step: int) -> Experience:
        """Rollout with the weights of `step` (dynamic sampling and online DPO wait for the scores here: they
        decide what is trained; otherwise scoring runs on while the trainer goes on)."""
        s, n = self.s, self.s.n
        records = next(self.loader)
        fields = {r.index: getattr(r, "fields", {}) for r in records}
        if s.offline_pairs:
            rollout = preference_rollout(records, self.dims)
            return Experience(rollout, Ready(Scores(torch.zeros(rollout.index.size))), fields)
        with self.timer.phase("rollout"), self.session(step - 1):
            rollout = self.rollout.generate(records, n=n, step=step, group_base=0)
            metrics = {**sync_metrics(self.rollout, self.timer), **rollout.metrics}
            if not s.dynamic_sampling:
                return Experience(rollout, self.scorer.submit(rollout.held, rollout.index.size), fields, metrics)
            rounds = []
            while True:
                scored = self.scorer.score(rollout.held, rollout.index.size)
                rounds.append((rollout, scored, dynamic.keep_mask(rollout.index, scored)))
                if sum(int(k.sum()) for *_, k in rounds) >= len(records) * n or len(rounds) >= s.max_sampling_rounds:
                    break
                more = next(self.loader)
                fields.update({r.index: r.fields for r in more})
                seed_step, base = refill_seeds(step, len(rounds))
                rollout = self.rollout.generate(more, n=n, step=seed_step, group_base=base)
        rollout, scored = dynamic.merge_rounds(rounds, len(records) * n)
        if rollout.index.size == 0:
            raise no_signal(len(rounds))
        return Experience(rollout, Ready(scored), fields, dict(metrics, **{"rollout/sampling_rounds": float(len(rounds))}))

    def state_dict(self) -> dict:
        return {"kind": "sync"}

    def rank_state(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, rank_state: dict) -> None:
        """Nothing to restore (the loader's position is the trainer's); a buffered run's checkpoint still holds
        samples that this source would lose, so it is refused."""
        if state.get("kind", "sync") != "sync":
            raise ValueError("this checkpoint was written by an asynchronous run (its experience buffer holds samples "
                             "not trained yet); resume it with rollout.mode=sidecar")


def sync_metrics(rollout: RolloutWorker, timer: PhaseTimer) -> dict[str, float]:
    """The last weight update's cost: its seconds into the step's timings, its bytes as a metric."""
    rep = rollout.last_sync()
    timer.add("sync", rep.sync_s)
    timer.add("switch", rep.switch_s)
    return {"sync/bytes_per_rank": float(rep.bytes_per_rank)}


def no_signal(rounds: int) -> TrainingError:
    return TrainingError(f"dynamic sampling kept no group in {rounds} rounds (every group's rewards were all equal); "
                         "raise algorithm.max_sampling_rounds or check the reward")
