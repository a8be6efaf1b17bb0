"""Reward shaping: outcome scores to token rewards, and DAPO's overlong penalty.

Shapes: `B` sequences, `T` response tokens; `mask` is `[B, T]`, 1 on real response tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def token_rewards(scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0,
                  turn_rewards: Tensor | None = None) -> Tensor:
    """Token-level rewards `[B, T]`, the `rewards` input of `gae` and `reinforce_pp`.

    Each row's outcome score sits on its last masked token; with KL in the reward, `kl_coef * kl` is
    subtracted on every masked token. A row with an empty mask has no token to carry its score and
    gets all zeros. `kl` is not read where `mask == 0`, nor at all when `kl_coef == 0`.

    `turn_rewards` `[B, T]` (multi-turn: each model turn's step reward on its last token, `turn_reward_tokens`):
    those rewards stay where they were earned and the last token carries the score less their sum, so a row's
    rewards still add up to its score (what the outcome estimators use) while GAE's returns give a turn's tokens
    the rewards of that turn and the later ones only.
    """
    keep = mask.bool()
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    turns = None
    if turn_rewards is not None:
        turns = torch.where(keep, turn_rewards.to(scores.dtype), 0)
        scores = scores - turns.sum(-1)
    positions = torch.arange(keep.shape[1], device=keep.device)
    last = torch.where(keep, positions, -1).amax(-1, keepdim=True)  # [B, 1]; -1 for an empty row
    rewards = torch.where(positions == last, scores[:, None], 0)
    if turns is not None:
        rewards = rewards + turns
    if kl is not None and kl_coef != 0:
        rewards = rewards - kl_coef * torch.where(keep, kl, 0)
    return rewards


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment `[B]`, added to the outcome score.

    0 up to `max_len - buffer_len` tokens, then linear down to `-penalty_factor` at `max_len`, and
    `-penalty_factor` beyond (a truncated response). Softer than a flat penalty for every truncation,
    which punishes sound reasoning that merely ran long.
    """
    if not 0 <= buffer_len <= max_len:
        raise ValueError(f"need 0 <= buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    lengths = lengths.to(torch.get_default_dtype())
    if buffer_len == 0:
        excess = (lengths > max_len).to(lengths.dtype)
    else:
        excess = ((lengths - (max_len - buffer_len)) / buffer_len).clamp(0, 1)
    return -penalty_factor * excess


def turn_reward_tokens(mask: Tensor, per_turn: list[list[float] | None]) -> Tensor:
    """`[B, T]`: row `b`'s k-th model turn (its k-th run of masked tokens) carries `per_turn[b][k]` on its last token,
    0 elsewhere. A row with no per-turn rewards (None), or whose runs do not match its turns (a model turn that
    sampled no token), gets zeros: its whole reward stays on its last token."""
    out = torch.zeros(mask.shape, dtype=torch.get_default_dtype())
    keep = mask.bool()
    for b, rewards in enumerate(per_turn):
        if not rewards or not any(rewards):
            continue
        row = keep[b]
        ends = torch.nonzero(row & ~torch.cat([row[1:], row.new_zeros(1)])).flatten()  # last token of each run
        if len(ends) == len(rewards):
            out[b, ends] = torch.tensor(rewards, dtype=out.dtype)
    return out
