"""Packed forward passes over samples: actor/reference log-probs, critic values, reward-model scores.

Every pass packs a micro-batch of samples into one row (no padding), runs the model once, and
scatters the response-token outputs back to `[b, T]`. Micro-batches are cut by a token budget, and
every rank runs the same number of them (FSDP forwards are collective), so the count is agreed with
an all-reduce before the first one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybrid_rl.data import PackedBatch, ResponseIndex, pack, split_by_token_budget
from hybrid_rl.dist.mesh import all_reduce_max, device
from hybrid_rl.model.logprobs import logits_to_logprobs
from hybrid_rl.types import Sample


@dataclass(frozen=True)
class MicroBatch:
    """Samples `indices` packed into one row, with where their response tokens are."""

    indices: list[int]
    packed: PackedBatch
    response: ResponseIndex


def micro_batches(samples: list[Sample], token_budget: int) -> list[MicroBatch]:
    """Cut `samples` into packed micro-batches of at most `token_budget` tokens, as many on every rank."""
    lengths = [s.length for s in samples]
    count = int(all_reduce_max([len(split_by_token_budget(lengths, token_budget))])[0])
    count = min(count, len(samples)) if samples else count
    out = []
    for idx in split_by_token_budget(lengths, token_budget, min_micro_batches=count):
        packed = pack([list(samples[i].prompt_ids + samples[i].response_ids) for i in idx])
        packed = PackedBatch(packed.input_ids.to(device()), packed.position_ids.to(device()),
                             packed.cu_seqlens.to(device()), packed.max_seqlen, packed.seq_lens)
        resp = packed.response_index([len(samples[i].prompt_ids) for i in idx],
                                     [len(samples[i].response_ids) for i in idx])
        out.append(MicroBatch(idx, packed, resp))
    return out


def _forward(model, mb: MicroBatch):
    return model(input_ids=mb.packed.input_ids, position_ids=mb.packed.position_ids, use_cache=False)


def policy_logprobs(model, mb: MicroBatch, *, temperature: float, with_entropy: bool = False):
    """Log-probs `[b, T]` (and entropies) of the response tokens of one micro-batch, with the autograd graph."""
    logits = _forward(model, mb).logits[0]
    r = mb.response
    targets = mb.packed.input_ids[0, r.target_positions]
    out = logits_to_logprobs(logits[r.logit_positions], targets, temperature=temperature, with_entropy=with_entropy)
    if with_entropy:
        lp, ent = out
        return r.scatter(lp)[0], r.scatter(ent)[0]
    return r.scatter(out)[0]


def token_values(model, mb: MicroBatch) -> torch.Tensor:
    """Critic values `[b, T]` at the positions that predict each response token (the state before it)."""
    values = _forward(model, mb).logits[0, :, 0].float()
    return mb.response.scatter(values[mb.response.logit_positions])[0]


def sequence_scores(model, mb: MicroBatch) -> torch.Tensor:
    """Reward-model scores `[b]`: the score head at each sequence's last token.

    The model is called as a whole (FSDP's root hooks gather its weights); its own pooling picks one
    token of the packed row, so the head's per-token output is captured with a hook instead.
    """
    captured = {}
    handle = model.score.register_forward_hook(lambda _m, _i, out: captured.__setitem__("scores", out))
    try:
        model(input_ids=mb.packed.input_ids, position_ids=mb.packed.position_ids, use_cache=False)
    finally:
        handle.remove()
    last = mb.packed.cu_seqlens[1:].long() - 1
    return captured["scores"][0, last, 0].float()


@torch.no_grad()
def gather_per_token(fn: Callable[[MicroBatch], torch.Tensor], mbs: list[MicroBatch], n: int, width: int) -> torch.Tensor:
    """Run `fn` over micro-batches without grad and assemble `[n, width]` on the CPU, rows in sample order."""
    out = torch.zeros(n, width)
    for mb in mbs:
        vals = fn(mb).float().cpu()
        out[mb.indices, : vals.shape[1]] = vals
    return out
