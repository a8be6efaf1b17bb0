"""Model passes of one RL step on this rank's share: no-grad passes, then the actor and critic updates.

Micro-batches are packed and cut by a token budget. Losses use the whole mini-batch's token and
sequence counts, summed over micro-batches and ranks, so the gradient does not depend on how the
mini-batch was cut; FSDP averages gradients over ranks, so each micro-batch loss is multiplied by
the world size to turn that average back into the global sum.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from hybrid_rl.algos import explained_variance, value_loss
from hybrid_rl.algos.objectives import MicroInputs, ObjectiveSettings, get_objective
from hybrid_rl.dist.mesh import all_reduce_sum
from hybrid_rl.model.forward import MicroBatch, gather_per_token, micro_batches, policy_logprobs, token_values
from hybrid_rl.model.handle import Model
from hybrid_rl.types import Sample, TrainBatch


def response_mask(samples: list[Sample], width: int) -> torch.Tensor:
    lens = torch.tensor([len(s.response_ids) for s in samples])
    return torch.arange(width)[None, :] < lens[:, None]


def width_of(samples: list[Sample]) -> int:
    return max((len(s.response_ids) for s in samples), default=1) or 1


@torch.no_grad()
def logprobs_pass(model: torch.nn.Module, samples: list[Sample], *, temperature: float, budget: int) -> torch.Tensor:
    """Log-probs `[B, T]` of the response tokens (reference or pre-update actor), on the CPU."""
    mbs = micro_batches(samples, budget)
    return gather_per_token(lambda mb: policy_logprobs(model, mb, temperature=temperature), mbs, len(samples),
                            width_of(samples))


@torch.no_grad()
def values_pass(model: torch.nn.Module, samples: list[Sample], *, budget: int) -> torch.Tensor:
    mbs = micro_batches(samples, budget)
    return gather_per_token(lambda mb: token_values(model, mb), mbs, len(samples), width_of(samples))


@dataclass(frozen=True)
class UpdateSettings:
    epochs: int
    mini_batches: int
    budget: int
    temperature: float
    grad_clip: float
    horizon: int  # the max response length: Dr. GRPO's constant denominator
    world: int


def _mini_batches(n: int, k: int) -> list[list[int]]:
    size = math.ceil(n / k)
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def _denominators(batch: TrainBatch, horizon: int) -> dict:
    """Token / sequence / pair counts of a mini-batch over all ranks."""
    tokens, seqs = batch.mask.sum().item(), (batch.mask.sum(-1) > 0).sum().item()
    pairs = 0 if batch.pairs is None else len(batch.pairs)
    tokens, seqs, pairs = all_reduce_sum([tokens, seqs, pairs])
    return {"num_tokens": max(tokens, 1.0), "num_seqs": max(seqs, 1.0), "horizon": float(horizon),
            "num_pairs": max(pairs, 1.0)}


def _rows(x: torch.Tensor | None, mb: MicroBatch, width: int, dev) -> torch.Tensor | None:
    return None if x is None else x[mb.indices, :width].to(dev)


def _local_pairs(batch: TrainBatch, mb: MicroBatch) -> torch.Tensor | None:
    if batch.pairs is None:
        return None
    pos = {i: j for j, i in enumerate(mb.indices)}
    keep = [(pos[c], pos[r]) for c, r in batch.pairs.tolist() if c in pos and r in pos]
    return torch.tensor(keep, dtype=torch.long).view(-1, 2)


class StepStats:
    """Token-weighted means of micro-batch stats."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, stats: dict[str, float], weight: float) -> None:
        for k, v in stats.items():
            self.sums[k] += v * weight
            self.weights[k] += weight

    def means(self, prefix: str) -> dict[str, float]:
        """Token-weighted means over all micro-batches of all ranks (every rank has the same keys)."""
        keys = sorted(self.sums)
        totals = all_reduce_sum([self.sums[k] for k in keys] + [self.weights[k] for k in keys])
        n = len(keys)
        return {f"{prefix}/{k}": totals[i] / totals[n + i] for i, k in enumerate(keys) if totals[n + i]}


def update_actor(actor: Model, batch: TrainBatch, objective: str, settings: ObjectiveSettings,
                 u: UpdateSettings) -> tuple[dict[str, float], bool]:
    """PPO-style epochs over mini-batches; returns (stats, finite). A non-finite step is not applied.

    ``batch.old_logp`` None: the batch gets one optimizer step, so each micro-batch's own log-probs,
    detached, are the old ones (ratio 1, as a separate pass would give); they are kept in
    ``batch.old_logp`` for the step's metrics.
    """
    reuse = batch.old_logp is None
    if reuse and u.epochs * u.mini_batches != 1:
        raise ValueError("old log-probs can come from the update only when it makes one optimizer step, "
                         f"not {u.epochs} epochs x {u.mini_batches} mini-batches")
    seen = torch.zeros(batch.mask.shape) if reuse else None
    loss_fn, stats, finite = get_objective(objective), StepStats(), True
    grad_norms = []
    for _ in range(u.epochs):
        for idx in _mini_batches(len(batch.samples), u.mini_batches):
            sub = batch.select(idx) if batch.pairs is None else batch
            denoms = _denominators(sub, u.horizon)
            for mb in micro_batches(sub.samples, u.budget):
                want_entropy = objective == "ppo_clip"
                out = policy_logprobs(actor.module, mb, temperature=u.temperature, with_entropy=want_entropy)
                logp, ent = out if want_entropy else (out, None)
                w = logp.shape[1]
                dev = logp.device
                if seen is not None:  # one mini-batch of all rows: mb.indices index the batch
                    seen[mb.indices, :w] = logp.detach().float().cpu()
                old = logp.detach() if reuse else _rows(sub.old_logp, mb, w, dev)
                x = MicroInputs(logp, ent, _rows(sub.mask, mb, w, dev), old, _rows(sub.advantages, mb, w, dev),
                                _rows(sub.ref_logp, mb, w, dev), _local_pairs(sub, mb))
                loss, s = loss_fn(x, settings, denoms)
                (loss * u.world).backward()
                stats.add(s, float(x.mask.sum()))
            norm, ok = _step(actor, u.grad_clip)
            grad_norms.append(norm)
            finite &= ok
    if seen is not None:
        batch.old_logp = seen
    out = stats.means("actor")
    out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["actor/lr"] = actor.optimizer.param_groups[0]["lr"]
    return out, finite


def update_critic(critic: Model, batch: TrainBatch, *, value_clip: float, loss_agg: str,
                  u: UpdateSettings) -> tuple[dict[str, float], bool]:
    stats, finite = StepStats(), True
    for _ in range(u.epochs):
        for idx in _mini_batches(len(batch.samples), u.mini_batches):
            sub = batch.select(idx)
            denoms = _denominators(sub, u.horizon)
            for mb in micro_batches(sub.samples, u.budget):
                v = token_values(critic.module, mb)
                w, dev = v.shape[1], v.device
                mask = _rows(sub.mask, mb, w, dev)
                loss, s = value_loss(v, _rows(sub.values, mb, w, dev), _rows(sub.returns, mb, w, dev), mask,
                                     value_clip, loss_agg, num_tokens=denoms["num_tokens"],
                                     num_seqs=denoms["num_seqs"], horizon=denoms["horizon"])
                (loss * u.world).backward()
                stats.add(dict(s, value_loss=loss.item()), float(mask.sum()))
            _, ok = _step(critic, u.grad_clip)
            finite &= ok
    out = stats.means("critic")
    out["critic/explained_variance"] = float(explained_variance(batch.values, batch.returns, batch.mask))
    return out, finite


def _step(model: Model, grad_clip: float) -> tuple[float, bool]:
    """Clip, check, step. A NaN/Inf gradient norm skips the optimizer step (gradients dropped)."""
    params = [p for p in model.module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = float(norm)
    ok = math.isfinite(norm)
    if ok:
        model.optimizer.step()
    model.optimizer.zero_grad(set_to_none=True)
    return norm, ok
