"""Per-token log-probabilities (and entropies) from a causal LM, on packed or padded input.

Packed input is one row of concatenated sequences with `position_ids` restarting at 0 for each
sequence and no attention mask: transformers then keeps attention inside each sequence (flash-attn
varlen on CUDA; a block-diagonal mask with SDPA on CPU). The log-prob of token t is read from the
logits at position t-1, so callers pass `targets` already shifted (`targets[i]` = the token that
follows position i).
"""

from __future__ import annotations

import torch


def logits_to_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                       chunk: int = 1024, with_entropy: bool = False):
    """log softmax(logits / T)[target] per position, in float32, `chunk` positions at a time (bounded memory).

    Returns `logprobs` shaped like `targets`, and the entropies too when `with_entropy`.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    tgt = targets.reshape(-1)
    lps, ents = [], []
    for i in range(0, flat.shape[0], chunk):
        x = flat[i : i + chunk].float()
        if temperature != 1.0:
            x = x / temperature
        lse = torch.logsumexp(x, dim=-1)
        lps.append(x.gather(-1, tgt[i : i + chunk, None]).squeeze(-1) - lse)
        if with_entropy:
            p = torch.softmax(x, dim=-1)
            ents.append(lse - (p * x).sum(-1))
    lp = torch.cat(lps).view(targets.shape)
    if with_entropy:
        return lp, torch.cat(ents).view(targets.shape)
    return lp


def forward_logprobs(model, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor, *,
                     temperature: float = 1.0, with_entropy: bool = False, attention_mask=None):
    """Run the model on `input_ids` [B, L] and return log-probs of `targets` [B, L] at every position."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
    return logits_to_logprobs(out.logits, targets, temperature=temperature, with_entropy=with_entropy)
