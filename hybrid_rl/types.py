"""The contracts between stages of the RL step: what rollout produces and the trainer consumes.

Plain frozen dataclasses; tensors are annotated with their shapes (`B` samples, `T` response tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Sample:
    """One prompt with one sampled response, as every stage after rollout sees it."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]  # the sampler's log-prob of each response token
    truncated: bool  # stopped by the length limit, not by EOS
    group: int  # samples of the same prompt share a group id (unique within a step)
    record_index: int  # the dataset row it came from
    fields: Mapping[str, Any]  # the row's reward fields (ground_truth, tests, ...)
    response_text: str

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class Scores:
    """Rewards of a list of samples: the weighted total and each reward function's part."""

    total: torch.Tensor  # [B] float32
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B]
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0


@dataclass
class TrainBatch:
    """This rank's share of a step's samples with everything the update needs, padded to [B, T]."""

    samples: list[Sample]
    mask: torch.Tensor  # [B, T] bool, real response tokens
    scores: torch.Tensor  # [B] outcome reward
    old_logp: torch.Tensor | None  # [B, T] training model's log-probs before the update (None: the update's own)
    advantages: torch.Tensor  # [B, T]
    ref_logp: torch.Tensor | None = None  # [B, T]
    values: torch.Tensor | None = None  # [B, T] critic values before the update
    returns: torch.Tensor | None = None  # [B, T] value targets
    pairs: torch.Tensor | None = None  # [P, 2] (chosen, rejected) sample indices, for DPO objectives

    def select(self, idx: list[int]) -> TrainBatch:
        """The rows `idx` (a mini-batch), every tensor sliced alike."""
        t = torch.tensor(idx, dtype=torch.long)
        pick = lambda x: None if x is None else x[t]  # noqa: E731
        return TrainBatch([self.samples[i] for i in idx], self.mask[t], self.scores[t], pick(self.old_logp),
                          self.advantages[t], pick(self.ref_logp), pick(self.values), pick(self.returns), None)
