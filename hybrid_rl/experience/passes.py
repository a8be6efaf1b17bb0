"""The no-grad model passes of a step on this rank's share: old log-probs, reference, teacher, critic, reward model.

The trainer brackets each pass with the offload manager's `resident` (models offloaded between
steps come in for their pass). Outputs are `[B, T]` on the CPU
(per token) or `[B]` (the reward model), rows in the share's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_rl.model.forward import (
    gather_per_token,
    micro_batches,
    policy_logprobs,
    replayed,
    sequence_scores,
    token_values,
)
from hybrid_rl.model.routing_replay import Replay, record_routes
from hybrid_rl.types import Sample


def width_of(samples: list[Sample]) -> int:
    return max((s.response_len for s in samples), default=1) or 1


@torch.no_grad()
def logprobs_pass(model: torch.nn.Module, samples: list[Sample], *, temperature: float, budget: int,
                  replay: Replay | None = None, record: list[torch.Tensor | None] | None = None,
                  share: bool = False) -> torch.Tensor:
    """Log-probs `[B, T]` of the response tokens (reference or pre-update actor), on the CPU.

    MoE routing replay: `replay` (an accumulator of what the routers did): the forwards use the samples' routes;
    `record` (one slot per sample): each sample's own routes of this pass, `[length, layers, top_k]`, go there.
    `share`: prefix-shared micro-batches (`model.forward.micro_batches`); not while recording routes."""
    mbs = micro_batches(samples, budget, routes=replay is not None, share=share and record is None)

    def fn(mb):
        if record is None or mb.is_filler:
            with replayed(model, mb, replay):
                return policy_logprobs(model, mb, temperature=temperature)
        with record_routes(model) as rec:
            out = policy_logprobs(model, mb, temperature=temperature)
        for i, r in zip(mb.indices, rec.routes().split(list(mb.packed.seq_lens)), strict=True):
            record[i] = r
        return out

    return gather_per_token(fn, mbs, len(samples), width_of(samples))


@torch.no_grad()
def values_pass(model: torch.nn.Module, samples: list[Sample], *, budget: int, share: bool = False) -> torch.Tensor:
    mbs = micro_batches(samples, budget, share=share)
    return gather_per_token(lambda mb: token_values(model, mb), mbs, len(samples), width_of(samples))


@torch.no_grad()
def scores_pass(model: torch.nn.Module, samples: list[Sample], *, budget: int) -> torch.Tensor:
    """Reward-model scores `[B]`."""
    out = torch.zeros(len(samples))
    for mb in micro_batches(samples, budget):
        scores = sequence_scores(model, mb).cpu()
        if not mb.is_filler:
            out[mb.indices] = scores
    return out


@dataclass
class PassOutputs:
    old_logp: torch.Tensor | None = None  # [B, T]; None when the update's own forward gives it
    ref_logp: torch.Tensor | None = None  # [B, T]
    teacher_logp: torch.Tensor | None = None  # [B, T] the distillation teacher's log-probs of the sampled tokens
    values: torch.Tensor | None = None  # [B, T]
    rm_scores: torch.Tensor | None = None  # [B]
