"""Which experience source a run takes its batches from (`source.py`), chosen by what its rollout worker can do.

A worker that streams (sidecar servers) feeds the experience buffer (`buffered.BufferedSource`), whose
`rollout.max_staleness` = 0 is the synchronous loop sample for sample; colocated vLLM and offline
preference pairs are generated (or read) when the step asks (`source.SyncSource`).
"""

from __future__ import annotations

from hybrid_rl.data import PromptLoader
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.experience.buffered import BufferedSource
from hybrid_rl.experience.scoring import Scorer
from hybrid_rl.experience.source import ExperienceSource, Session, SourceSettings, SyncSource, TrainingError
from hybrid_rl.rollout.base import RolloutWorker, StreamingRollout
from hybrid_rl.utils.timer import PhaseTimer

__all__ = ["ExperienceSource", "SourceSettings", "TrainingError", "open_source"]


def open_source(rollout: RolloutWorker, loader: PromptLoader, scorer: Scorer, dims: ParallelDims, timer: PhaseTimer,
                session: Session, settings: SourceSettings) -> ExperienceSource:
    if isinstance(rollout, StreamingRollout) and not settings.offline_pairs:
        return BufferedSource(rollout, loader, scorer, dims, timer, session, settings)
    return SyncSource(rollout, loader, scorer, dims, timer, session, settings)
