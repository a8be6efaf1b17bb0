"""Sequence packing (and the padded baseline), plus the index maps back to per-sequence tensors.

Shape letters: S = sequences, N = packed tokens (sum of lengths), L = longest sequence, R = response tokens
of all sequences together, T = longest response.

The policy forward on a `PackedBatch` is a Hugging Face causal LM called as
`model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)` with no attention mask:
transformers then finds the sequence boundaries where `position_ids` restarts at 0 and keeps attention inside
each sequence (sdpa and eager build a block-diagonal causal mask; flash-attn uses varlen kernels).
`use_cache=False` is REQUIRED, even in train mode: with the config default `use_cache=True` the model builds a
KV cache, the packed-sequence detection is skipped, and every sequence silently attends to the ones before it
(sdpa and eager, transformers 5.19; pinned by `tests/unit/data/test_packed_forward.py`). sdpa and eager
materialise an [N, N] mask, so long packs cost N^2 bytes; flash-attn does not, and can be given the
boundaries directly (`cu_seq_lens_q=cu_seq_lens_k=cu_seqlens, max_length_q=max_length_k=max_seqlen`), which
spares it inferring them from `position_ids` with a device-to-host sync.

Log-probs of response tokens: the logits at flat position p predict the token at p + 1, so the log-prob of
response token t (at flat position p_t) is read from the logits at p_t - 1, which is inside the same sequence
because every prompt has at least one token. `ResponseIndex` holds both position lists, so that only the R
needed rows of logits go through log_softmax (not all N x vocab).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

TokenSequences = Sequence[Sequence[int]] | Sequence[torch.Tensor]


@dataclass(frozen=True)
class ResponseIndex:
    """Where the response tokens of a `PackedBatch` are, and how to pad their values to `[S, T]`.

    Attributes:
        target_positions: [R] int64, flat positions of the response tokens (the labels).
        logit_positions: [R] int64, flat positions whose logits predict them (`target_positions - 1`).
        sequence_ids: [R] int64, the sequence each response token belongs to.
        offsets: [R] int64, each token's position within its response (0 for the first response token).
        response_lens: response length of each sequence.
    """

    target_positions: torch.Tensor
    logit_positions: torch.Tensor
    sequence_ids: torch.Tensor
    offsets: torch.Tensor
    response_lens: tuple[int, ...]

    def scatter(self, values: torch.Tensor, *, pad_value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad per-response-token values [R, ...] into [S, T, ...], with a [S, T] bool mask of real tokens.

        Differentiable with respect to `values`.
        """
        return _scatter(values, self.sequence_ids, self.offsets, self.response_lens, pad_value)


@dataclass(frozen=True)
class PackedBatch:
    """S sequences laid end to end in one row, with what attention kernels need to keep them apart.

    Attributes:
        input_ids: [1, N] int64.
        position_ids: [1, N] int64, restarting at 0 at the start of every sequence.
        cu_seqlens: [S + 1] int32, cumulative lengths (sequence s spans `cu_seqlens[s]:cu_seqlens[s + 1]`).
        max_seqlen: the longest sequence, L.
        seq_lens: the length of each sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_lens: tuple[int, ...]

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def unpack(self, values: torch.Tensor, *, pad_value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad per-token values [N, ...] (or [1, N, ...]) into [S, L, ...], with a [S, L] bool mask.

        Differentiable with respect to `values`.
        """
        if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == self.num_tokens:
            values = values[0]
        if values.shape[0] != self.num_tokens:
            raise ValueError(f"values has {values.shape[0]} tokens in its first dim, the batch has {self.num_tokens}")
        lens = torch.tensor(self.seq_lens, device=self.position_ids.device)
        sequence_ids = torch.repeat_interleave(torch.arange(self.num_sequences, device=lens.device), lens)
        return _scatter(values, sequence_ids, self.position_ids[0], self.seq_lens, pad_value)

    def response_index(self, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> ResponseIndex:
        """Index the response tokens, given each sequence's (prompt_len, response_len) with prompt_len >= 1.

        Log-probs of the responses then read, for `logits` [1, N, V]:
        `logits[0, idx.logit_positions].log_softmax(-1).gather(-1, input_ids[0, idx.target_positions, None])`.
        """
        if len(prompt_lens) != self.num_sequences or len(response_lens) != self.num_sequences:
            raise ValueError(
                f"got {len(prompt_lens)} prompt and {len(response_lens)} response lengths for {self.num_sequences} "
                "sequences; expected one of each per sequence"
            )
        for s, (p, r, n) in enumerate(zip(prompt_lens, response_lens, self.seq_lens, strict=True)):
            if p < 1 or r < 0 or p + r != n:
                raise ValueError(
                    f"sequence {s}: prompt_len {p} + response_len {r} != its length {n}; expected prompt_len >= 1, "
                    "response_len >= 0, adding up to the sequence length"
                )
        # Sizes come from the Python lengths (`output_size`): nothing here reads a device tensor back.
        device, total = self.cu_seqlens.device, sum(int(r) for r in response_lens)
        lens = torch.tensor(response_lens, dtype=torch.int64, device=device)
        sequence_ids = torch.repeat_interleave(torch.arange(self.num_sequences, device=device), lens, output_size=total)
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
        offsets = torch.arange(total, device=device) - starts
        prompt_lens_t = torch.tensor(prompt_lens, dtype=torch.int64, device=device)
        response_starts = self.cu_seqlens[:-1].to(torch.int64) + prompt_lens_t
        target_positions = response_starts[sequence_ids] + offsets
        return ResponseIndex(
            target_positions=target_positions,
            logit_positions=target_positions - 1,
            sequence_ids=sequence_ids,
            offsets=offsets,
            response_lens=tuple(int(r) for r in response_lens),
        )


def pack(sequences: TokenSequences) -> PackedBatch:
    """Lay `sequences` (lists of ids or 1-D tensors, each non-empty) end to end into one [1, N] row.

    The outputs live on the device of the first tensor given (CPU for lists).
    """
    tensors = _as_tensors(sequences)
    device = tensors[0].device
    sizes = [t.numel() for t in tensors]  # Python ints: no device read for any size below
    lens = torch.tensor(sizes, dtype=torch.int64, device=device)
    cu_seqlens = torch.zeros(len(tensors) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = torch.cumsum(lens, 0)
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), lens, output_size=sum(sizes))
    position_ids = torch.arange(sum(sizes), device=device) - starts
    return PackedBatch(
        input_ids=torch.cat([t.to(device) for t in tensors])[None],
        position_ids=position_ids[None],
        cu_seqlens=cu_seqlens,
        max_seqlen=max(sizes),
        seq_lens=tuple(sizes),
    )


def pad(sequences: TokenSequences, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad `sequences` to [S, L]: (input_ids, attention_mask (int64, 1 = real token), position_ids).

    Position ids count 0..len-1 over the real tokens and are 0 on padding (never attended to). Pass all three
    to the model: with an attention mask present, transformers does no packed-sequence detection.
    """
    tensors = _as_tensors(sequences)
    device = tensors[0].device
    lens = torch.tensor([t.numel() for t in tensors], device=device)
    width = int(lens.max())
    positions = torch.arange(width, device=device)[None].expand(len(tensors), -1)
    attention_mask = (positions < lens[:, None]).to(torch.int64)
    input_ids = torch.full((len(tensors), width), pad_id, dtype=torch.int64, device=device)
    input_ids[attention_mask.bool()] = torch.cat([t.to(device) for t in tensors])
    return input_ids, attention_mask, positions * attention_mask


def _as_tensors(sequences: TokenSequences) -> list[torch.Tensor]:
    if len(sequences) == 0:
        raise ValueError("no sequences to pack; expected at least one")
    tensors = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in sequences]
    empty = [i for i, t in enumerate(tensors) if t.numel() == 0]
    if empty:
        raise ValueError(f"sequences {empty} are empty; expected at least one token each")
    return tensors


def _scatter(
    values: torch.Tensor, sequence_ids: torch.Tensor, offsets: torch.Tensor, lens: Sequence[int], pad_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lens, default=0)
    padded = values.new_full((len(lens), width, *values.shape[1:]), pad_value)
    sequence_ids, offsets = sequence_ids.to(values.device), offsets.to(values.device)
    padded = padded.index_put((sequence_ids, offsets), values)
    mask = torch.zeros(len(lens), width, dtype=torch.bool, device=values.device)
    mask[sequence_ids, offsets] = True
    return padded, mask
