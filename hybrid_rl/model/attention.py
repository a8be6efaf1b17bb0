"""Packed attention without flash-attn: PyTorch SDPA run once per sequence of a packed row.

transformers' own SDPA path handles packed input (one row, `position_ids` restarting at 0) with a
block-diagonal `T x T` mask, which disables SDPA's fused causal kernels, repeats the KV heads for
GQA and costs attention over the whole packed length: quadratic in the micro-batch, not in each
sequence. On CPU that made a packed micro-batch slower than padding it. Here each sequence runs
SDPA with `is_causal=True` and `enable_gqa`, so the cost is the sum of the squares of the
sequence lengths, as with flash-attn varlen on CUDA, and no per-layer mask is kept for backward.

Nor is the mask built: transformers would still make the `T x T` block-diagonal mask once per
forward (a gigabyte and seconds at 32k packed tokens, measured), so `packed_mask` returns none
where no padding mask is given and the whole input is new tokens (no KV cache); the attention
above needs none then.

A prefix-shared row (`data/tree.py`, `trainer.prefix_share`; the layout comes in as `packed_tree`) runs per group
one causal SDPA over the prompt and one over its responses, padded into a batch, each attending to [prompt keys,
its own keys] under a lower-right causal mask (`tree_sdpa`).

Anything else (padded batches with a mask, decoding with a KV cache) goes to transformers' SDPA
and its mask builder unchanged. Registered under `PACKED_SDPA`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from hybrid_rl.types import MATH_MAX_LEN

PACKED_SDPA = "hybrid_rl_packed_sdpa"
_ALL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                 SDPBackend.MATH]


def _sequence_lengths(kwargs: dict, position_ids: torch.Tensor | None, total: int) -> list[int] | None:
    """The lengths of the sequences of one packed row of `total` tokens, or None when the row is not packed input.

    The trainer's forward passes them as Python ints (`packed_seq_lens`, from the packing), so the attention of every
    layer reads no device tensor. Without them, from `cu_seq_lens_q` (one device read per layer), else from where
    `position_ids` restart at 0 (two)."""
    lengths = kwargs.get("packed_seq_lens")
    if lengths is not None:
        return list(lengths) if sum(lengths) == total else None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        bounds = cu.tolist()
        return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)] if bounds[-1] == total else None
    if position_ids is None or int(position_ids[0, 0]) != 0:
        return None
    starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [total]
    return [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """`query` [1, heads, T, d], `key`/`value` [1, kv_heads, T, d] -> ([1, T, heads, d], None)."""
    lengths, tree = None, kwargs.pop("packed_tree", None)
    if query.shape[0] == 1 and query.shape[2] == key.shape[2] > 1:
        if tree is not None and sum(tree.segment_lens) == query.shape[2]:
            kwargs.pop("packed_seq_lens", None)
            return tree_sdpa(query, key, value, tree.segments, scaling, dropout), None
        lengths = _sequence_lengths(kwargs, kwargs.get("position_ids"), query.shape[2])
    kwargs.pop("packed_seq_lens", None)
    if lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    # `split`, not a slice per sequence: a slice's backward writes its gradient into a zero tensor of the whole
    # packed length, so n sequences cost n full-size fills and adds per layer; split's backward is one concatenation.
    out = [_causal(q, k, v, scaling, gqa, dropout)
           for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def tree_sdpa(query, key, value, segments, scaling, dropout: float = 0.0) -> torch.Tensor:
    """Attention over a prefix-shared row (`data/tree.py`): `[1, heads, T, d]` -> `[1, T, heads, d]`.

    Per segment: the prefix runs causally on its own; its branches, padded to the longest, run as one batch of
    one SDPA each attending to [prefix keys, own keys] with a lower-right causal mask (a branch row sees the whole
    prefix and its own tokens up to itself; padding is never attended by a real row, and its outputs are dropped).
    A segment of one branch is a plain sequence: one causal SDPA."""
    gqa = query.shape[1] != key.shape[1]
    lens = [p + sum(b) for p, b in segments]
    out = []
    for (p, branches), q, k, v in zip(segments, query.split(lens, 2), key.split(lens, 2), value.split(lens, 2),
                                      strict=True):
        if len(branches) == 1:
            out.append(_causal(q, k, v, scaling, gqa, dropout))
            continue
        # `split` here too: slices' backward would fill a segment-length zero tensor per slice
        (qp, qb), (kp, kb), (vp, vb) = (x.split([p, sum(branches)], 2) for x in (q, k, v))
        out.append(_causal(qp, kp, vp, scaling, gqa, dropout))
        if sum(branches):
            out.append(_branches(qb, kp, vp, kb, vb, branches, scaling, gqa, dropout))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()


def _causal(q, k, v, scaling, gqa: bool, dropout: float) -> torch.Tensor:
    with sdpa_kernel(_backends(q.device, q.shape[2])):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                              enable_gqa=gqa)


def _padded(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """`[1, heads, sum(lens), d]` -> `[branches, heads, max(lens), d]`, zero-padded."""
    parts = x[0].transpose(0, 1).split(lens)  # [len, heads, d] each
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True).permute(0, 2, 1, 3)


def _branches(q, kp, vp, kb, vb, branches: tuple[int, ...], scaling, gqa: bool, dropout: float) -> torch.Tensor:
    """The branches of one segment against [prefix, own tokens]: `[1, heads, sum(branches), d]`."""
    lens, n, p = list(branches), len(branches), kp.shape[2]
    width = max(lens)
    qs = _padded(q, lens)
    ks = torch.cat([kp.expand(n, -1, -1, -1), _padded(kb, lens)], dim=2)
    vs = torch.cat([vp.expand(n, -1, -1, -1), _padded(vb, lens)], dim=2)
    mask = torch.ones(width, p + width, dtype=torch.bool, device=q.device).tril(diagonal=p)
    with sdpa_kernel(_backends(q.device, p + width)):
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                           enable_gqa=gqa)
    return torch.cat([o[i, :, :m] for i, m in enumerate(lens) if m], dim=1)[None]


def _backends(device: torch.device, length: int) -> list[SDPBackend]:
    """SDPA's kernels allowed for one sequence of `length` tokens.

    On CPU a short sequence (RL prompts and responses are often under a hundred tokens) goes to the math
    kernel. The fused flash kernel's fixed cost per call (buffers allocated and zeroed per call) made its
    backward 7 ms a call for a 65-token sequence of 14 heads inside the trainer: 2.8 s of a 0.5B update of 16
    such sequences (24 layers); with the math kernel the update took 4 s less (benchmarks/results/notes_202611.md). Measured
    alone, fwd + bwd of 2048 tokens of 14 heads: math 2.0x faster than flash at 64 tokens a sequence, 1.35x at
    128, even at 256, slower beyond. The math kernel keeps each sequence's `heads x L x L` float32 scores
    and float32 q, k, v for backward (the memory plan counts them: `planner/activations.py`).
    """
    if device.type == "cpu" and length <= MATH_MAX_LEN:
        return [SDPBackend.MATH]
    return _ALL_BACKENDS


def packed_mask(*args, attention_mask=None, q_length: int = 0, kv_length: int = 0, q_offset: int = 0,
                kv_offset: int = 0, **kwargs):
    """No mask for unpadded input without a cache (see the module docstring); else transformers' SDPA mask."""
    if attention_mask is None and q_length == kv_length and q_offset == kv_offset == 0:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, **kwargs)


def register() -> str:
    """Make `PACKED_SDPA` a valid `attn_implementation` (idempotent); returns its name."""
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, packed_mask)
    return PACKED_SDPA
