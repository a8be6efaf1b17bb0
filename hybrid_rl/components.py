"""What `build` hands the trainer: the built components and the trainer's typed settings.

The trainer reads no config: `build` turns the config into these frozen settings (keyword arguments, one group per
concern), so the trainer sees only what it uses and cannot depend on how the config is laid out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybrid_rl.algos.objectives import ObjectiveSettings
from hybrid_rl.data import PromptLoader
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.distributed.offload import OffloadManager
from hybrid_rl.experience.batch import BatchSettings
from hybrid_rl.experience.source import SourceSettings
from hybrid_rl.model.handle import Model
from hybrid_rl.planner.result import MemoryPlan
from hybrid_rl.rewards import RewardPool
from hybrid_rl.rollout.base import RolloutWorker
from hybrid_rl.updates import UpdateSettings


@dataclass(frozen=True)
class LoopSettings:
    """The run's course: length, checkpoints, validation, export, and when it stops."""

    output_dir: Path
    total_steps: int
    save_every: int  # 0: only at the end
    val_every: int  # 0: only before and after training
    keep_last: int  # checkpoints kept
    resume: str  # auto | never
    export: bool  # a Hugging Face folder of the policy at the end
    show_progress: bool
    max_bad_steps: int  # non-finite steps in a row before the run stops
    max_logprob_diff: float | None  # the mismatch guard's limit; None or 0: off
    val_greedy: bool


@dataclass(frozen=True)
class KLSettings:
    """The KL penalty's coefficient (adaptive towards `target` when > 0) and its estimator."""

    coef: float
    target: float
    horizon: int
    estimator: str


@dataclass(frozen=True)
class PassSettings:
    """The model passes before the update."""

    old_logp_from_update: bool  # the update's own forward gives the old log-probs: no separate pass
    use_reference: bool
    temperature: float
    budget: int  # tokens per micro-batch
    prefix_share: bool = False  # a group's prompt computed once per micro-batch (`data/tree.py`)


@dataclass(frozen=True)
class TrainerSettings:
    objective: str  # algos/objectives.py registry name
    offline_pairs: bool  # offline DPO: pairs from the dataset, nothing generated or scored
    value_clip: float
    loop: LoopSettings
    kl: KLSettings
    passes: PassSettings
    loss: ObjectiveSettings  # with the rollout correction (`loss.correction`)
    updates: UpdateSettings
    batch: BatchSettings
    source: SourceSettings
    offload: Mapping[str, str]  # frozen model name (reference, critic, reward_model, teacher) -> none|cpu|disk
    config: Mapping[str, Any] = field(default_factory=dict)  # the whole config as a plain dict, saved in checkpoints
    # MoE routing replay (`model.moe.router_replay`, none for a dense model): rollout replays vLLM's experts in every
    # forward; old records the old-log-prob pass's experts and replays them in the update
    router_replay: str = "none"


@dataclass
class Components:
    settings: TrainerSettings
    dims: ParallelDims
    tokenizer: object
    actor: Model
    rollout: RolloutWorker
    train_loader: PromptLoader
    val_records: list
    rewards: RewardPool | None
    reference: Model | None
    critic: Model | None
    reward_model: Model | None
    offload: OffloadManager
    plan: MemoryPlan
    run_id: str = ""  # sidecar mode: the run's unique id (its etcd keys, weight versions; saved in checkpoints)
    teacher: Model | None = None  # on-policy distillation's frozen teacher (teacher.path)
