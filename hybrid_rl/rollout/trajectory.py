"""A multi-turn trajectory as token ids: what the engine saw, turn by turn, and what the trainer will train on.

The trajectory only ever grows at its end (append-only): model turns are the ids the engine sampled, with their
log-probs; context (tool results, template boundary tokens, the next generation prompt) is ids from
`chat_template.ToolSuffix`. Nothing is rendered again and re-tokenised, so the ids trained are, id for id, those
the engine saw. The loss mask is 1 on exactly the model's tokens; context tokens carry log-prob 0 and mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_rl.types import Sample


@dataclass
class Trajectory:
    """One sample's conversation in the making. `prompt_ids` are fixed; everything after is the response."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)  # True: the model sampled this token
    logprobs: list[float] = field(default_factory=list)  # the sampler's, 0.0 on context tokens
    turns: int = 0  # model turns
    tool_calls: int = 0
    malformed_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    truncated: bool = False  # the response budget ran out (mid-turn, or before a tool result fitted)
    infra_failed: bool = False  # a tool's infrastructure failed: the sample is excluded from statistics and loss
    done: bool = False
    log: list[dict[str, Any]] = field(default_factory=list)  # the calls and results, for the reward and dumps
    # black-box agents (`stitch.stitch`): the policy version that sampled each response token, a context token taking
    # the version of the model token before it; empty when the calls carried none
    versions: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)  # per model turn: the environment's step rewards
    user_turns: int = 0  # messages an environment's user simulator (`respond`) answered with

    @property
    def context(self) -> list[int]:
        """What the engine is given for the next turn."""
        return self.prompt_ids + self.response_ids

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    def add_model(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} log-probs")
        self.response_ids += ids
        self.loss_mask += [True] * len(ids)
        self.logprobs += list(logprobs)
        self.turns += 1
        self.turn_rewards.append(0.0)

    def add_context(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def to_sample(self, uid: int, group: int, record_index: int, fields) -> Sample:
        return Sample(uid, torch.tensor(self.prompt_ids, dtype=torch.int64),
                      torch.tensor(self.response_ids, dtype=torch.int64),
                      torch.tensor(self.logprobs, dtype=torch.float32), self.truncated, group, record_index, fields,
                      loss_mask=torch.tensor(self.loss_mask, dtype=torch.bool))
