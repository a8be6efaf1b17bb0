"""The contracts between stages of the RL step: what rollout produces and the trainer consumes.

Plain frozen dataclasses. Shape letters: `N` samples of the whole step (all ranks), `B` samples of
this rank's training share, `T` response tokens (the longest in the share), `P` pairs.

Token ids and log-probs are 1-D tensors, never Python tuples: a step at scale holds millions of
tokens, and everything that touches them (packing, the exchange between ranks, the log-prob check)
is vectorised. Each sample lives on the rank that holds it (`Rollout.held`, then the training
share); what every rank knows about every sample is the small `BatchIndex`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

# What a model ends in: causal LM (the policy, the reference), critic (token classification), reward model (sequence
# classification); loading builds it, the memory planner counts its parameters.
Head = Literal["lm", "value", "score"]
# On CPU, `model/attention.py` runs sequences up to this long through SDPA's math kernel (faster there than the fused
# kernel: see its `_backends`), whose saved tensors the memory plan counts (`planner/activations.py`).
MATH_MAX_LEN = 128


@dataclass(frozen=True, eq=False)
class Sample:
    """One prompt with one sampled response, as every stage after rollout sees it."""

    uid: int  # its row in the step's batch (0..N-1), the same on every rank
    prompt_ids: torch.Tensor  # [prompt tokens] int64
    response_ids: torch.Tensor  # [response tokens] int64
    rollout_logprobs: torch.Tensor  # [response tokens] float32: the sampler's; empty when none (offline pairs)
    truncated: bool  # stopped by the length limit, not by EOS
    group: int  # samples of the same prompt share a group id
    record_index: int  # the dataset row it came from (`PromptRecord.index`)
    fields: Mapping[str, Any]  # the row's reward fields (ground_truth, tests, ...)
    # [response tokens] int64: the policy version (optimizer steps taken) whose weights sampled each token; empty when
    # the generator does not record it (colocated, offline pairs: every token is the current policy's)
    token_versions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    # [response tokens] bool: the tokens the loss covers (the model's own); empty: every response token. A multi-turn
    # trajectory's tool results and template tokens sit inside the response as context, mask 0 (`rollout/trajectory`)
    loss_mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    # its place in its episode: 0 for a sample of its own; k for the (k+1)-th trajectory a black-box agent's episode
    # was stitched into (`sidecar/stitch.py`). An episode's trajectories have consecutive uids in call order, and the
    # last one carries the episode's reward (`BatchIndex.episodes`)
    part: int = 0
    # [tokens, MoE layers, top_k] uint8/int16: the experts the rollout's forward chose for the prompt and response
    # tokens in order (a response's last token was never fed back, so at most length - 1 rows); empty: none recorded
    # (dense models, replay off, generators that do not capture them)
    routes: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, 0, dtype=torch.uint8))

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def length(self) -> int:
        return self.prompt_len + self.response_len

    def renumbered(self, uid: int, group: int | None = None) -> Sample:
        return replace(self, uid=uid, group=self.group if group is None else group)


@dataclass(frozen=True)
class BatchIndex:
    """One row per sample of the step, identical on every rank: what balancing, group statistics and
    metrics need, without the tokens."""

    prompt_lens: torch.Tensor  # [N] int64
    response_lens: torch.Tensor  # [N] int64
    groups: torch.Tensor  # [N] int64
    truncated: torch.Tensor  # [N] bool
    parts: torch.Tensor | None = None  # [N] int64: each sample's `Sample.part` (None: every sample is its own episode)
    # [N] int64: the tokens the model sampled (a multi-turn response less its tool and template tokens); None: all of
    # the response
    model_lens: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.groups.shape[0])

    @property
    def episodes(self) -> torch.Tensor | None:
        """[N] int64: each sample's episode, numbered 0.. in uid order; None when every sample is an episode of its
        own (the usual case: one response, or one tool-loop trajectory, per request)."""
        if self.parts is None or not bool(self.parts.any()):
            return None
        return torch.cumsum((self.parts == 0).long(), 0) - 1

    @property
    def episode_ends(self) -> torch.Tensor:
        """[N] bool: the last sample of each episode (the one its reward was judged on; every sample when each is an
        episode of its own)."""
        if self.parts is None:
            return torch.ones(self.size, dtype=torch.bool)
        return torch.cat([self.parts[1:] == 0, torch.ones(min(self.size, 1), dtype=torch.bool)])

    @property
    def lengths(self) -> torch.Tensor:
        return self.prompt_lens + self.response_lens

    def select(self, uids: torch.Tensor) -> BatchIndex:
        """The rows `uids` (whole episodes: an episode cut in two would no longer start at part 0)."""
        return BatchIndex(self.prompt_lens[uids], self.response_lens[uids], self.groups[uids], self.truncated[uids],
                          None if self.parts is None else self.parts[uids],
                          None if self.model_lens is None else self.model_lens[uids])

    @property
    def own_lens(self) -> torch.Tensor:
        """[N] int64: the tokens each response's model sampled (what length shaping judges)."""
        return self.response_lens if self.model_lens is None else self.model_lens


@dataclass(frozen=True)
class Rollout:
    """What generation produced: the samples this rank holds (sorted by uid) and the index of all of them.

    Every sample is held by exactly one rank (one of the TP ranks of the data-parallel group that
    generated it); that rank scores it and sends its tokens to the rank that trains on it.
    """

    held: list[Sample]
    index: BatchIndex
    # what the rollout measured (the same on every rank), e.g. multi-turn's tool calls per trajectory
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Scores:
    """Rewards of the step's samples, on every rank: the weighted total and each reward function's part."""

    total: torch.Tensor  # [N] float32
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0  # the slowest rank's scoring time


@dataclass
class TrainBatch:
    """This rank's training share with everything the update needs, padded to [B, T].

    Rows come unit by unit: a unit is one sample, or for preference objectives one (chosen, rejected)
    pair in two adjacent rows; units are never split between ranks, mini-batches or micro-batches.
    """

    samples: list[Sample]
    mask: torch.Tensor  # [B, T] bool, real response tokens
    scores: torch.Tensor  # [B] outcome reward
    old_logp: torch.Tensor | None  # [B, T] training model's log-probs before the update (None: the update's own)
    advantages: torch.Tensor  # [B, T]
    ref_logp: torch.Tensor | None = None  # [B, T]
    values: torch.Tensor | None = None  # [B, T] critic values before the update
    returns: torch.Tensor | None = None  # [B, T] value targets
    paired: bool = False  # rows (2k, 2k + 1) are preference pair k: (chosen, rejected)
    rollout_logp: torch.Tensor | None = None  # [B, T] the sampler's log-probs, 0-padded (None: offline pairs)
    # [B, T] int64: policy versions between the weights that sampled each token and those trained now, 0-padded
    # (None: the generator records no versions, so every token is on-policy by construction)
    staleness: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None  # [B, T] a distillation teacher's log-probs of the sampled tokens

    @property
    def units(self) -> list[list[int]]:
        step = 2 if self.paired else 1
        return [list(range(i, min(i + step, len(self.samples)))) for i in range(0, len(self.samples), step)]

    def select(self, idx: list[int]) -> TrainBatch:
        """The rows `idx` (whole units, in order: a mini-batch), every tensor sliced alike."""
        t = torch.tensor(idx, dtype=torch.long)
        pick = lambda x: None if x is None else x[t]  # noqa: E731
        return TrainBatch([self.samples[i] for i in idx], self.mask[t], self.scores[t], pick(self.old_logp),
                          self.advantages[t], pick(self.ref_logp), pick(self.values), pick(self.returns), self.paired,
                          pick(self.rollout_logp), pick(self.staleness), pick(self.teacher_logp))


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one generate call."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    """One sampled response: token ids, the sampler's log-prob of each, and why it stopped."""

    prompt_index: int
    token_ids: Sequence[int]  # as vLLM returns them (the sampler turns them into one tensor)
    logprobs: Sequence[float]
    finish_reason: str  # "stop" | "length"
    # (weight version, first token, end token) spans over the response, as a vLLM server stamps them (partial
    # rollouts: a request paused for a weight update continues under the next version); () when not recorded
    weight_spans: tuple[tuple[str, int, int], ...] = ()
    # [prompt + response - 1 tokens, MoE layers, top_k] uint8/int16: the experts vLLM chose for each token it
    # computed (`colocated/routes.py`); None: not captured
    routes: torch.Tensor | None = None
    # speculative rollout (`rollout.speculative`): tokens drafted for this response and how many the policy accepted
    spec_drafted: int = 0
    spec_accepted: int = 0


@dataclass(frozen=True)
class Request:
    key: int  # the caller's id for the sample
    prompt: list[int]
    seed: int
    affinity: int | None = None  # requests with the same value go to the same server (None: the key)
    row: Mapping[str, Any] | None = None  # black-box agents: the dataset row the agent plays (not sent to a server)
