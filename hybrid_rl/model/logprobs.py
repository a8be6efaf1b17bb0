"""Per-token log-probabilities (and entropies) from logits, without a float32 `[tokens, vocab]` copy.

The logits of a micro-batch's response positions are `[R, V]` in the compute dtype (bf16 with the
default mixed precision); with a 150k vocabulary that is already 0.3 MB per token. Upcasting them
to float32 for `log_softmax`, as autograd would keep for backward, doubles that again and a second
float32 copy appears for the entropy. `ChunkedLogProbs` instead works `chunk` positions at a time in
float32 and keeps for backward only the logits themselves and two floats per position; backward
recomputes each chunk's softmax and writes the gradient chunk by chunk into one tensor of the
logits' dtype. Peak extra memory: one float32 chunk (`chunk x V`), whatever R is.

Gradients (x = logits / T, p = softmax(x), lse = logsumexp(x), H = entropy):
  d logp[target] / dx = onehot(target) - p
  d H / dx           = -p * (log p + H)
each times 1/T for the logits.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A float32 copy of `logits / T` (always a copy: it is modified in place afterwards)."""
    x = logits.to(torch.float32, copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


def _logsumexp_(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of a float32 `[rows, V]`, overwriting `x` (torch.logsumexp allocates two more
    `[rows, V]` tensors: `x - max` and its exp, each one more pass over fresh memory)."""
    m = x.amax(-1, keepdim=True)
    m.masked_fill_(~torch.isfinite(m), 0.0)  # a row of -inf stays -inf (as torch.logsumexp), not NaN
    return x.sub_(m).exp_().sum(-1).log_().add_(m.squeeze(-1))


class ChunkedLogProbs(torch.autograd.Function):
    """(logp [R], entropy [R]) of `targets` under softmax(logits / T), chunked; differentiable in `logits`.

    Each chunk works in two float32 buffers of `chunk x V`, updated in place. Without `entropy` the entropies
    are not computed (zeros): they cost an exp, a product and a sum over the whole `[R, V]` (0.4 s of a 0.5B
    update of 512 response tokens with a 152k vocabulary, measured).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int,
                entropy: bool = True):
        n = logits.shape[0]
        lps = torch.empty(n, dtype=torch.float32, device=logits.device)
        ents, lses = (torch.empty_like if entropy else torch.zeros_like)(lps), torch.empty_like(lps)
        for i in range(0, n, chunk):
            x = _scaled(logits[i : i + chunk], temperature)
            picked = x.gather(-1, targets[i : i + chunk, None]).squeeze(-1)
            if entropy:  # log p is needed whole: the logsumexp works in a copy
                lse = _logsumexp_(x.clone())
                ents[i : i + chunk] = -(logp := x.sub_(lse[:, None])).exp().mul_(logp).sum(-1)
            else:
                lse = _logsumexp_(x)
            lps[i : i + chunk] = picked - lse  # = log p at the target, to the bit, either way
            lses[i : i + chunk] = lse
        ctx.save_for_backward(logits, targets, lses, ents)
        ctx.temperature, ctx.chunk, ctx.entropy = temperature, chunk, entropy
        ctx.set_materialize_grads(False)
        return lps, ents

    @staticmethod
    def backward(ctx, grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None):
        logits, targets, lses, ents = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad = torch.zeros_like(logits) if grad_lp is None and grad_ent is None else torch.empty_like(logits)
        with_ent = grad_ent is not None and ctx.entropy
        for i in range(0, logits.shape[0] if grad_lp is not None or grad_ent is not None else 0, chunk):
            logp = _scaled(logits[i : i + chunk], t).sub_(lses[i : i + chunk, None])
            g = logp.exp() if with_ent else logp.exp_()  # p (in place where log p is not needed again)
            if with_ent:  # dH/dx = -p (log p + H): built in the log-p buffer
                logp.add_(ents[i : i + chunk, None]).mul_(g).mul_(-grad_ent[i : i + chunk, None].float())
            if grad_lp is not None:  # dlogp/dx = onehot - p
                g_lp = grad_lp[i : i + chunk, None].float()
                g.mul_(-g_lp).scatter_add_(-1, targets[i : i + chunk, None], g_lp)
                if with_ent:
                    g.add_(logp)
            else:
                g = logp if with_ent else g.zero_()
            grad[i : i + chunk] = g.div_(t) if t != 1.0 else g
        return grad, None, None, None, None


def logits_to_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                       chunk: int = DEFAULT_CHUNK, with_entropy: bool = False):
    """log softmax(logits / T)[target] per position, in float32 (`targets` already shifted: `targets[i]` is
    the token that follows position i); also the entropies when `with_entropy`. Shapes like `targets`."""
    flat = logits.reshape(-1, logits.shape[-1])
    lp, ent = ChunkedLogProbs.apply(flat, targets.reshape(-1), temperature, chunk, with_entropy)
    lp = lp.view(targets.shape)
    return (lp, ent.view(targets.shape)) if with_entropy else lp


def forward_logprobs(model, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor, *,
                     temperature: float = 1.0, with_entropy: bool = False, attention_mask=None):
    """Run the model on `input_ids` [B, L] and return log-probs of `targets` [B, L] at every position."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
    return logits_to_logprobs(out.logits, targets, temperature=temperature, with_entropy=with_entropy)
