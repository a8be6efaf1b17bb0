"""Prefix-shared packing: the samples of a group laid out as one tree, [prompt, response_1, ..., response_n].

The `n` samples of a GRPO group share their prompt; packed one after another (`packing.pack`) every one of them
recomputes it. Here a group is one *segment* of the packed row: the prompt once, then each response. The attention
(`model/attention.py`, given the `TreeLayout`) runs the prompt causally and each response over [prompt, itself],
causally; the position ids of every response continue from the prompt's length, so RoPE sees what it sees unshared.
The log-prob of a response's first token is read from the prompt's last position (shared by the branches, each
with its own label), the others from the position before them, as unshared. A sample alone is a segment of one
branch, which is exactly a packed sequence.

Everything here is computed from Python lengths: the attention reads no device tensor to find the segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybrid_rl.data.packing import PackedBatch, ResponseIndex


@dataclass(frozen=True)
class TreeLayout:
    """The segments of a prefix-shared packed row: per segment `(prefix_len, branch_lens)`, in row order.

    A segment spans `prefix_len + sum(branch_lens)` tokens: its prefix, then its branches one after another."""

    segments: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def segment_lens(self) -> tuple[int, ...]:
        return tuple(p + sum(b) for p, b in self.segments)

    @property
    def shared(self) -> bool:
        """Whether any segment has more than one branch (else the row is plain packing)."""
        return any(len(b) > 1 for _, b in self.segments)


def shared_length(prompt_len: int, response_lens: Sequence[int]) -> int:
    """Tokens of a group's segment: the prompt once and every response."""
    return prompt_len + sum(response_lens)


def pack_tree(groups: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], device: torch.device | str | None = None
              ) -> tuple[PackedBatch, TreeLayout, ResponseIndex]:
    """Lay out `groups` (a prompt and its responses, each prompt non-empty) as one prefix-shared row.

    Returns the row (`seq_lens`/`cu_seqlens` are the segments'; `position_ids` restart at 0 at every segment and
    continue from the prompt's length in every branch), its layout, and where the response tokens and the logits
    that predict them are. The responses are numbered in order over all groups (the rows of `ResponseIndex.scatter`).
    Built where the tokens are (the host, as samples are kept), then moved to `device` (default: the tokens') in one
    copy per tensor.
    """
    if not groups:
        raise ValueError("no groups to pack; expected at least one")
    segments, tokens, positions = [], [], []
    for prompt, responses in groups:
        p = int(prompt.numel())
        if p < 1:
            raise ValueError("a prompt of a prefix-shared group is empty; expected at least one token")
        lens = tuple(int(r.numel()) for r in responses)
        segments.append((p, lens))
        tokens += [prompt.reshape(-1), *(r.reshape(-1) for r in responses)]
        positions += [torch.arange(p), *(torch.arange(p, p + n) for n in lens)]
    layout = TreeLayout(tuple(segments))
    dev = tokens[0].device if device is None else torch.device(device)
    seg = layout.segment_lens
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg), 0)
    packed = PackedBatch(torch.cat([t.to(tokens[0].device) for t in tokens])[None].to(dev),
                         torch.cat(positions)[None].to(dev),
                         cu.to(dev), max(seg), seg)
    return packed, layout, _response_index(layout, dev)


def _response_index(layout: TreeLayout, device: torch.device) -> ResponseIndex:
    """Per branch: its start in the row, its length, and the row position of its prompt's last token."""
    starts, lens, prompt_ends, offset = [], [], [], 0
    for p, branches in layout.segments:
        s = offset + p
        for n in branches:
            starts.append(s)
            lens.append(n)
            prompt_ends.append(offset + p - 1)
            s += n
        offset += p + sum(branches)
    total = sum(lens)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    sequence_ids = torch.repeat_interleave(torch.arange(len(lens)), lens_t, output_size=total)
    first = torch.cumsum(lens_t, 0) - lens_t
    offsets = torch.arange(total) - torch.repeat_interleave(first, lens_t, output_size=total)
    targets = torch.tensor(starts, dtype=torch.int64)[sequence_ids] + offsets
    logits = targets - 1
    nonempty = lens_t > 0
    # A response's first token is predicted by its prompt's last position, not by the previous branch's last token.
    logits[first[nonempty]] = torch.tensor(prompt_ends, dtype=torch.int64)[nonempty]
    return ResponseIndex(targets.to(device), logits.to(device), sequence_ids.to(device), offsets.to(device),
                         tuple(lens))
