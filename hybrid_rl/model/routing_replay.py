"""Routing replay for a mixture of experts: the trainer's forward uses given experts instead of choosing its own.

Without it the trainer's router picks other experts than vLLM's for a few percent of (token, layer) pairs, and
the importance ratios of those tokens explode (R3: replay the rollout's routes; R2: replay the trainer's own
old-log-prob pass). Here, for transformers' routers (`Qwen3MoeTopKRouter` and those shaped like it: forward
returns `(router_logits, routing_weights, selected_experts)` over the flattened tokens):

* `record_routes(model)`: a context that collects each MoE layer's selected experts, `[tokens, layers, top_k]`
  in the smallest integer dtype that holds the expert count (what a sample carries);
* `replay_routes(model, routes)`: a context in which each layer's selected experts are `routes[:, layer]`; the
  routing weights are recomputed from the trainer's own router logits *at those experts* (softmax, then top-k
  renormalised when the config says so, as the router does), so the router still gets gradients. The replayed
  routes are fixed for the whole context, so activation checkpointing's recompute (the layers fire again in
  backward) replays the same experts. `agreement` counts, before replay overrides them, the (token, layer)
  pairs on which the trainer's own router picked the same set of experts (`moe/router_agreement`).

Tokens are those of the forward's `input_ids`, flattened in order (a packed row is one sequence of tokens:
its routes are the concatenation of the samples' routes, in the same order).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of `model` in layer order (a module with `top_k`, `num_experts` and a `weight`)."""
    return [m for name, m in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids 0..num_experts-1."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32768 else torch.int32


@dataclass
class Recorded:
    per_layer: list[torch.Tensor] = field(default_factory=list)

    def routes(self) -> torch.Tensor:
        """[tokens, layers, top_k], smallest integer dtype."""
        return torch.stack(self.per_layer, dim=1)


@contextmanager
def record_routes(model: nn.Module):
    """Collect each MoE layer's selected experts of the next forward (the first firing of each layer only:
    a checkpointed recompute fires them again with the same choice)."""
    rs = routers(model)
    rec = Recorded([None] * len(rs))

    def hook(i: int, router: nn.Module):
        def fn(_module, _args, out):
            if rec.per_layer[i] is None:
                rec.per_layer[i] = out[2].detach().to(route_dtype(router.num_experts)).cpu()
        return fn

    handles = [r.register_forward_hook(hook(i, r)) for i, r in enumerate(rs)]
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


@dataclass
class Replay:
    agree: int = 0  # (token, layer) pairs whose own top-k set equals the replayed one (first firing of each layer)
    total: int = 0

    @property
    def agreement(self) -> float:
        return self.agree / self.total if self.total else 1.0


@contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor):
    """Forwards inside use `routes` ([tokens, layers, top_k], any integer dtype) as every layer's experts."""
    rs = routers(model)
    if routes.dim() != 3 or routes.shape[1] != len(rs):
        raise ValueError(f"routes must be [tokens, {len(rs)} MoE layers, top_k]; got {tuple(routes.shape)}")
    stats, seen = Replay(), set()

    def hook(i: int, router: nn.Module):
        def fn(_module, _args, out):
            logits, _, own = out
            chosen = routes[:, i].to(device=logits.device, dtype=torch.long)
            if chosen.shape != own.shape:
                raise ValueError(f"MoE layer {i}: replayed routes {tuple(chosen.shape)} for {tuple(own.shape)} "
                                 "selected experts (tokens x top_k) in this forward")
            if i not in seen:  # the recompute of a checkpointed layer is not counted twice
                seen.add(i)
                stats.agree += int((own.sort(-1).values == chosen.sort(-1).values).all(-1).sum())
                stats.total += own.shape[0]
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, chosen)
            if getattr(router, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return fn

    handles = [r.register_forward_hook(hook(i, r)) for i, r in enumerate(rs)]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
