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
def _hooked(rs: list[nn.Module], hook):
    """`hook(i, router)`'s forward hook on every router for the body (the hooks removed however it ends)."""
    handles = [r.register_forward_hook(hook(i, r)) for i, r in enumerate(rs)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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

    with _hooked(rs, hook):
        yield rec


@dataclass
class Replay:
    """What the trainer's routers did under replay, summed over the forwards of a context (first firing of each
    layer only): their own choice's agreement with the replayed one, the replayed experts' load, router entropy."""

    agree: int = 0  # replayed (token, layer) pairs whose own top-k set equals the replayed one
    total: int = 0  # replayed (token, layer) pairs
    load: torch.Tensor | None = None  # [layers, experts] tokens routed to each expert (what the experts computed)
    entropy: float = 0.0  # sum over (token, layer) of the router distribution's entropy (nats)
    routed: int = 0  # (token, layer) pairs behind `load` and `entropy`

    @property
    def agreement(self) -> float:
        return self.agree / self.total if self.total else 1.0

    def add(self, other: Replay) -> None:
        self.agree, self.total = self.agree + other.agree, self.total + other.total
        self.entropy, self.routed = self.entropy + other.entropy, self.routed + other.routed
        if other.load is not None:
            self.load = other.load.clone() if self.load is None else self.load + other.load

    def metrics(self) -> dict[str, float]:
        """Of every rank (collective): `moe/router_agreement` (replayed pairs only), `moe/load_balance` (max/mean
        tokens per expert, the mean over layers; 1 is perfectly even), `moe/router_entropy` (nats per token and
        layer); none of them when no forward replayed anything (no sample carried routes). A rank whose forwards
        replayed nothing (filler micro-batches only) joins with zeros."""
        from hybrid_rl.distributed.collectives import all_reduce, all_reduce_max

        layers, experts = self.load.shape if self.load is not None else (0, 0)
        layers, experts = (int(x) for x in all_reduce_max([float(layers), float(experts)]))
        load = self.load if self.load is not None else torch.zeros(layers, experts, dtype=torch.int64)
        sums = all_reduce(torch.cat([torch.tensor([self.agree, self.total, self.entropy, self.routed],
                                                  dtype=torch.float64), load.flatten().double()]))
        agree, total, entropy, routed = sums[:4].tolist()
        out = {"moe/router_agreement": agree / total} if total else {}
        if routed and layers:
            load = sums[4:].view(layers, experts)
            out["moe/load_balance"] = float((load.max(-1).values / load.mean(-1).clamp_min(1e-12)).mean())
            out["moe/router_entropy"] = entropy / routed
        return out


@contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor, known: torch.Tensor | None = None):
    """Forwards inside use `routes` ([tokens, layers, top_k], any integer dtype) as every layer's experts.

    `known` ([tokens] bool, default all): the tokens whose routes are given; the others keep the trainer's own
    choice and are not counted in the agreement (tokens no rollout forward saw: a response's last token)."""
    rs = routers(model)
    if routes.dim() != 3 or routes.shape[1] != len(rs):
        raise ValueError(f"routes must be [tokens, {len(rs)} MoE layers, top_k]; got {tuple(routes.shape)}")
    stats, seen = Replay(), set()
    if rs:
        stats.load = torch.zeros(len(rs), rs[0].num_experts, dtype=torch.int64)

    def hook(i: int, router: nn.Module):
        def fn(_module, _args, out):
            logits, _, own = out
            chosen = routes[:, i].to(device=logits.device, dtype=torch.long)
            if chosen.shape != own.shape:
                raise ValueError(f"MoE layer {i}: replayed routes {tuple(chosen.shape)} for {tuple(own.shape)} "
                                 "selected experts (tokens x top_k) in this forward")
            given = None if known is None else known.to(logits.device)
            if given is not None:
                chosen = torch.where(given[:, None], chosen, own)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            if i not in seen:  # the recompute of a checkpointed layer is not counted twice
                seen.add(i)
                _count(stats, i, own, chosen, given, probs.detach(), router.num_experts)
            weights = probs.gather(-1, chosen)
            if getattr(router, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return fn

    with _hooked(rs, hook):
        yield stats


@torch.no_grad()
def _count(stats: Replay, layer: int, own: torch.Tensor, chosen: torch.Tensor, given: torch.Tensor | None,
           probs: torch.Tensor, experts: int) -> None:
    """A layer's first firing into `stats`, outside autograd: a checkpointed forward must save the same tensors as
    its recompute, which does not count."""
    same = (own.sort(-1).values == chosen.sort(-1).values).all(-1)
    stats.agree += int(same.sum() if given is None else (same & given).sum())
    stats.total += own.shape[0] if given is None else int(given.sum())
    stats.load[layer] += torch.bincount(chosen.flatten(), minlength=experts).cpu()
    stats.entropy += float(-(probs * probs.clamp_min(1e-30).log()).sum())
    stats.routed += own.shape[0]
