"""The actor and critic updates of one RL step, on this rank's training share.

Mini-batches and micro-batches are cut over units (a sample, or a preference pair), never through
one. Losses use the whole mini-batch's token, sequence and pair counts, summed over micro-batches
and ranks, so the gradient does not depend on how the mini-batch was cut; FSDP averages gradients
over ranks, so each micro-batch loss is multiplied by the world size to turn that average back into
the global sum. Statistics stay on the device and are reduced and read once per update, inputs move host
to device through pinned memory without blocking, and log-probs kept for the step's metrics are read back
once at the end: no host sync per micro-batch (tests/unit/trainer/test_hot_loop.py counts them). The one
read per optimizer step is the gradient norm (a non-finite step is skipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid_rl.algos.losses import aggregate, value_loss_terms
from hybrid_rl.algos.masked import masked_sum
from hybrid_rl.algos.objectives import (
    Denominators,
    MicroInputs,
    Objective,
    ObjectiveSettings,
    StatSums,
    zero_like_loss,
)
from hybrid_rl.distributed.collectives import all_reduce, all_reduce_sum
from hybrid_rl.model.forward import MicroBatch, micro_batches, policy_logprobs, replayed, token_values
from hybrid_rl.model.handle import Model
from hybrid_rl.model.routing_replay import Replay
from hybrid_rl.types import Sample, TrainBatch


def response_mask(samples: list[Sample], width: int) -> torch.Tensor:
    lens = torch.tensor([s.response_len for s in samples], dtype=torch.int64)
    return torch.arange(width)[None, :] < lens[:, None]


@dataclass(frozen=True)
class UpdateSettings:
    epochs: int
    mini_batches: int
    budget: int
    temperature: float
    grad_clip: float
    horizon: int  # the max response length: Dr. GRPO's constant denominator
    world: int
    prefix_share: bool = False  # a group's prompt computed once per micro-batch (`data/tree.py`)


def split_units(units: list[list[int]], k: int) -> list[list[list[int]]]:
    """`k` mini-batches of consecutive units (fewer when there are fewer units); at least one, maybe empty."""
    size = max(1, math.ceil(len(units) / k))
    return [units[i : i + size] for i in range(0, len(units), size)] or [[]]


def denominators(batch: TrainBatch, horizon: int) -> Denominators:
    """Token / sequence / pair counts of a mini-batch over all ranks (one small all-reduce)."""
    local = torch.tensor([batch.mask.sum(), (batch.mask.sum(-1) > 0).sum(),
                          len(batch.samples) // 2 if batch.paired else 0], dtype=torch.float64)
    tokens, seqs, pairs = all_reduce(local).tolist()
    return Denominators(max(tokens, 1.0), max(seqs, 1.0), max(pairs, 1.0), float(horizon))


def rows(x: torch.Tensor | None, mb: MicroBatch, width: int, dev) -> torch.Tensor | None:
    """A micro-batch's rows of a host tensor, on `dev`: on CUDA through pinned memory and an asynchronous copy
    (a pageable host-to-device copy would block the host until it is done)."""
    if x is None:
        return None
    block = x[mb.indices, :width]
    if torch.device(dev).type == "cuda":
        return block.pin_memory().to(dev, non_blocking=True)
    return block.to(dev)


def _mb_pairs(batch: TrainBatch, mb: MicroBatch) -> torch.Tensor | None:
    """Pairs of a micro-batch as its own row positions: whole pairs only, by construction (pairs are units)."""
    if not batch.paired:
        return None
    pos = torch.arange(len(mb.indices))
    return pos.view(-1, 2)


class StepStats:
    """(sum, count) of each statistic over micro-batches, kept on the device they come from (no host sync per
    micro-batch); `means()` reduces over ranks and reads them once, at the end of the update."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, stats: StatSums) -> None:
        for k, (total, count) in stats.items():
            pair = torch.stack([torch.as_tensor(total).detach().double(), torch.as_tensor(count).detach().double()])
            self.sums[k] = self.sums[k] + pair.to(self.sums[k].device) if k in self.sums else pair

    def means(self, prefix: str) -> dict[str, float]:
        """Means over all micro-batches of all ranks (every rank adds the same keys, in any order)."""
        keys = sorted(self.sums)
        stacked = torch.stack([self.sums[k].cpu() for k in keys]) if keys else None
        totals = all_reduce(stacked).tolist() if keys else []
        return {f"{prefix}/{k}": t / c for k, (t, c) in zip(keys, totals, strict=True) if c}


def update_actor(actor: Model, batch: TrainBatch, objective: Objective, settings: ObjectiveSettings,
                 u: UpdateSettings, replay: Replay | None = None) -> tuple[dict[str, float], bool, torch.Tensor | None]:
    """PPO-style epochs over mini-batches; returns (stats, finite, old log-probs). A non-finite step is not applied.

    `replay` (MoE routing replay, an accumulator of what the routers did): every forward, and its checkpointed
    recompute in backward, uses the samples' routes (`Sample.routes`).

    ``batch.old_logp`` None: the batch gets one optimizer step, so each micro-batch's own log-probs,
    detached, are the old ones (ratio 1, as a separate pass would give); they are returned `[B, T]`
    for the step's metrics (else None).
    """
    reuse = batch.old_logp is None
    if reuse and u.epochs * u.mini_batches != 1:
        raise ValueError("old log-probs can come from the update only when it makes one optimizer step, "
                         f"not {u.epochs} epochs x {u.mini_batches} mini-batches")
    seen = None  # reuse: the update's own log-probs, gathered on the device, read once at the end
    stats, finite, grad_norms, pairs_used = StepStats(), True, [], 0
    packed = [0, 0]  # prefix sharing: tokens packed, tokens the samples hold (host ints: no sync)
    for _ in range(u.epochs):
        for units in split_units(batch.units, u.mini_batches):
            idx = [i for unit in units for i in unit]
            sub = batch.select(idx)
            d = denominators(sub, u.horizon)
            for mb in micro_batches(sub.samples, u.budget, units=_renumbered(units), routes=replay is not None,
                                    share=u.prefix_share):
                with replayed(actor.module, mb, replay):  # around backward too: a checkpointed recompute replays
                    out = policy_logprobs(actor.module, mb, temperature=u.temperature, with_entropy=objective.entropy)
                    logp, ent = out if objective.entropy else (out, None)
                    if mb.is_filler:
                        (zero_like_loss(logp) * u.world).backward()
                        continue
                    w, dev = logp.shape[1], logp.device
                    packed[0] += mb.packed.num_tokens
                    packed[1] += sum(sub.samples[i].length for i in mb.indices)
                    if reuse:  # one mini-batch of all rows: the mini-batch's rows are the batch's
                        if seen is None:
                            seen = torch.zeros(batch.mask.shape, device=dev)
                        seen[mb.indices, :w] = logp.detach().float()
                    old = logp.detach() if reuse else rows(sub.old_logp, mb, w, dev)
                    x = MicroInputs(logp, ent, rows(sub.mask, mb, w, dev), old, rows(sub.advantages, mb, w, dev),
                                    rows(sub.ref_logp, mb, w, dev), _mb_pairs(sub, mb),
                                    rows(sub.rollout_logp, mb, w, dev))
                    loss, s = objective.loss(x, settings, d)
                    (loss * u.world).backward()
                stats.add(s)
                pairs_used += 0 if x.pairs is None else len(x.pairs)
            norm, ok = _step(actor, u.grad_clip)
            grad_norms.append(norm)
            finite &= ok
    out = stats.means("actor")
    out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    if reuse:
        seen = torch.zeros(batch.mask.shape) if seen is None else seen.cpu()
    out["actor/lr"] = float(actor.optimizer.param_groups[0]["lr"])  # a tensor in torchao's optimizers
    if u.prefix_share:  # the share of the update's tokens the prefix-shared layout did not compute
        done, total = all_reduce_sum(packed)
        out["actor/prefix_saved_frac"] = 1.0 - done / total if total else 0.0
    if batch.paired:
        out["train/pairs_used"] = all_reduce_sum([pairs_used / u.epochs])[0]
    return out, finite, seen


def _renumbered(units: list[list[int]]) -> list[list[int]]:
    """The same units as rows of the mini-batch that holds them one after another."""
    out, k = [], 0
    for unit in units:
        out.append(list(range(k, k + len(unit))))
        k += len(unit)
    return out


def update_critic(critic: Model, batch: TrainBatch, *, value_clip: float, loss_agg: str,
                  u: UpdateSettings) -> tuple[dict[str, float], bool]:
    stats, finite = StepStats(), True
    for _ in range(u.epochs):
        for units in split_units(batch.units, u.mini_batches):
            sub = batch.select([i for unit in units for i in unit])
            d = denominators(sub, u.horizon)
            for mb in micro_batches(sub.samples, u.budget, share=u.prefix_share):
                v = token_values(critic.module, mb)
                if mb.is_filler:
                    (zero_like_loss(v) * u.world).backward()
                    continue
                w, dev = v.shape[1], v.device
                mask = rows(sub.mask, mb, w, dev)
                per_token, clipped = value_loss_terms(v, rows(sub.values, mb, w, dev), rows(sub.returns, mb, w, dev),
                                                      mask, value_clip)
                loss = aggregate(per_token, mask, loss_agg, **d.aggregate_kwargs())
                (loss * u.world).backward()
                count = mask.float().sum()
                stats.add({"value_loss": (masked_sum(per_token.detach(), mask), count),
                           "clip_frac": (masked_sum(clipped.float(), mask), count)})
            _, ok = _step(critic, u.grad_clip)
            finite &= ok
    out = stats.means("critic")
    out["critic/explained_variance"] = _explained_variance(batch)
    return out, finite


def _explained_variance(batch: TrainBatch) -> float:
    """Over the whole batch (all ranks): 1 - Var[R - V] / Var[R], from summed moments."""
    m = batch.mask.double()
    r, v = batch.returns.double() * m, batch.values.double() * m
    e = r - v
    n, sr, sr2, se, se2 = all_reduce(torch.stack([m.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum()])).tolist()
    if n < 2:
        return 0.0
    var_r = (sr2 - sr * sr / n) / (n - 1)
    var_e = (se2 - se * se / n) / (n - 1)
    return float(1 - var_e / var_r) if var_r > 0 else 0.0


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


