"""The RL loop. One step reads top to bottom: generate, score, estimate advantages, update, (sync next step).

Every rank runs the same code (SPMD). Rollout is data-parallel over vLLM TP groups and every rank
ends up with every sample; each rank then scores one share in reward worker processes while it
runs its model passes (old log-probs unless the update gives them, reference, critic, reward model)
on a token-balanced training share; advantages are computed on the whole batch, identically on every
rank; the update trains each rank's share with FSDP. Weights reach vLLM at the start of the next rollout.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid_rl.algos import ADVANTAGES, AdaptiveKLController, FixedKLController, groups_with_signal, kl
from hybrid_rl.algos.objectives import ObjectiveSettings
from hybrid_rl.algos.pairs import best_worst_pairs
from hybrid_rl.algos.shaping import overlong_penalty, token_rewards
from hybrid_rl.build import Components
from hybrid_rl.checkpoint import Checkpointer, export_hf
from hybrid_rl.config import to_dict
from hybrid_rl.data import balance_across_ranks
from hybrid_rl.dist.mesh import all_reduce_max, all_reduce_sum
from hybrid_rl.metrics import MetricsLogger
from hybrid_rl.model.forward import micro_batches, sequence_scores
from hybrid_rl.model.lora import adapter_disabled, is_lora, merge_full_state_dict, save_adapter
from hybrid_rl.model.phase_peaks import PhasePeaks
from hybrid_rl.planner import detect_device, plan_for
from hybrid_rl.types import Sample, TrainBatch
from hybrid_rl.updates import (
    UpdateSettings,
    logprobs_pass,
    response_mask,
    update_actor,
    update_critic,
    values_pass,
    width_of,
)
from hybrid_rl.utils.timer import PhaseTimer

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. repeated non-finite steps); the last good checkpoint is intact."""


class Trainer:
    def __init__(self, c: Components):
        self.c, self.cfg, self.dims = c, c.cfg, c.dims
        a, t = c.cfg.algorithm, c.cfg.trainer
        self.out = Path(t.output_dir)
        self.timer, self.peaks = PhaseTimer(), PhasePeaks()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", c.dims.world))
        self.plan = plan_for(c.cfg, c.dims.world, device=detect_device(local_ranks=local_ranks))
        self.kl_ctl = AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.kl_target > 0 \
            else FixedKLController(a.kl_coef)
        self.checkpointer = Checkpointer(self.out / "checkpoints", keep_last=t.keep_last, rank=c.dims.rank,
                                         world=c.dims.world)
        self.objective = ObjectiveSettings(a.loss_agg, a.clip_low, a.clip_high, a.dual_clip or None,
                                           0.0 if a.kl_in_reward else a.kl_coef, a.kl_estimator, a.entropy_coef,
                                           a.dpo_beta, a.dpo_kind, a.dpo_label_smoothing)
        self.updates = UpdateSettings(a.ppo_epochs, a.mini_batches, t.micro_batch_tokens, c.cfg.rollout.temperature,
                                      c.cfg.optim.grad_clip, c.cfg.rollout.max_new_tokens, c.dims.world)
        self.bad_steps = self.skipped_steps = 0
        self._stop = False
        self.metrics: MetricsLogger | None = None
        self.val_history: list[tuple[int, float]] = []

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> None:
        start = self._resume()
        t = self.cfg.trainer
        self.metrics = MetricsLogger(self.out, enabled=self.dims.is_main, total_steps=t.total_steps,
                                     start_step=start + 1 if start else 0, show_progress=t.show_progress)
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self._say(self.plan.table())
        if start == 0 and self.c.val_records:
            self._validate(0)
        step = start
        for step in range(start + 1, t.total_steps + 1):
            metrics = self.step(step)
            self.metrics.log(step, metrics)
            if step == start + 1:  # the first step's measured peaks, beside the prediction
                self._say(self.plan.table(measured=_measured(metrics)))
            stopping = bool(all_reduce_max([float(self._stop)])[0])
            if stopping or step == t.total_steps or (t.save_every and step % t.save_every == 0):
                self.save(step)
            if stopping:
                self._say(f"stopped by signal after step {step}; checkpoint saved. Resume with the same command "
                          f"(trainer.resume=auto, trainer.output_dir={self.out}).")
                return
            if self.c.val_records and t.val_every and step % t.val_every == 0 and step != t.total_steps:
                self._validate(step)
        if self.c.val_records:
            self._validate(step)
        if t.export:
            self._export()

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        records = next(self.c.train_loader)
        samples, scores, gen_metrics = self._generate(records, step)
        batch, pass_metrics = self._prepare(samples, scores, step)
        with self.timer.phase("update"):
            with self.peaks.phase("update"):
                stats, finite = update_actor(self.c.actor, batch, self.cfg.algorithm.objective, self.objective,
                                             self.updates)
            if (critic := self.c.critic) is not None:
                with self.peaks.phase("critic_update"), self._resident("critic", critic.module, critic.optimizer):
                    cstats, cfinite = update_critic(critic, batch, value_clip=self.cfg.algorithm.value_clip,
                                                    loss_agg=self.cfg.algorithm.loss_agg, u=self.updates)
                stats.update(cstats)
                finite &= cfinite
        # After the update: when it gave the old log-probs itself, they exist only now.
        old_metrics, kl_mean = self._old_logp_metrics(batch, bool(samples[0].rollout_logprobs))
        pass_metrics.update(old_metrics)
        self._schedulers_step(stats, kl_mean)
        self._track_finite(finite, step)
        metrics = {**gen_metrics, **pass_metrics, **stats, **self._timings(time.perf_counter() - t0, samples)}
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        return metrics

    # -- generate and score ------------------------------------------------------------------------

    def _generate(self, records, step: int) -> tuple[list[Sample], torch.Tensor | None, dict[str, float]]:
        """Samples for this step. Dynamic sampling (DAPO) scores here and keeps only groups with signal."""
        a, n = self.cfg.algorithm, self.cfg.rollout.n
        if a.offline_pairs:
            return _preference_samples(records), None, {}
        with self._phase("rollout"), self.c.engine.rollout_mode():
            samples = self.c.sampler.generate(records, n=n, step=step, group_base=0)
            self._switch_metrics = self._engine_metrics()
            if not a.dynamic_sampling:
                return samples, None, {}
            kept, kept_scores, rounds = [], [], 0
            while True:
                scores = self._score_all(samples).total
                keep = groups_with_signal(scores, [s.group for s in samples])
                kept += [s for s, k in zip(samples, keep.tolist(), strict=True) if k]
                kept_scores.append(scores[keep])
                rounds += 1
                if len(kept) >= len(records) * n or rounds >= a.max_sampling_rounds:
                    break
                more = next(self.c.train_loader)
                samples = self.c.sampler.generate(more, n=n, step=step * 1000 + rounds, group_base=rounds * 10**6)
        kept, scores = _trim_groups(kept, torch.cat(kept_scores), len(records) * n, n, self.dims.world)
        if not kept:
            raise TrainingError(f"dynamic sampling kept no group in {rounds} rounds (every group's rewards were all "
                                "equal); raise algorithm.max_sampling_rounds or check the reward")
        return kept, scores, {"rollout/sampling_rounds": float(rounds)}

    def _score_all(self, samples: list[Sample]):
        """Score all samples: each rank one share in its reward pool, then shared with all ranks."""
        handle, share = self._submit_scores(samples)
        return self._collect_scores(handle, share, len(samples))

    def _submit_scores(self, samples: list[Sample]):
        share = list(range(self.dims.rank, len(samples), self.dims.world))
        picked = [samples[i] for i in share]
        return self.c.rewards.submit([s.response_text for s in picked], [s.fields for s in picked]), share

    def _collect_scores(self, handle, share: list[int], n: int):
        res = handle.result()
        for f in res.failures[:3]:
            log.warning("reward %s %s on sample %d: %s", f.name, f.kind, share[f.index], f.message)
        names = list(res.by_name)
        rows = torch.zeros(n, 1 + len(names))
        for j, i in enumerate(share):
            rows[i, 0] = res.totals[j]
            for k, name in enumerate(names):
                rows[i, 1 + k] = res.by_name[name][j]
        if self.dims.world > 1:
            dist.all_reduce(rows)  # shares are disjoint: the sum assembles the batch
        errors, timeouts = all_reduce_sum([res.num_errors, res.num_timeouts])
        seconds = all_reduce_max([res.elapsed_s])[0]
        return _ScoreSet(rows[:, 0], {nm: rows[:, 1 + k] for k, nm in enumerate(names)}, (errors, timeouts, seconds))

    # -- model passes and advantages -------------------------------------------------------------

    def _prepare(self, samples: list[Sample], scores: torch.Tensor | None, step: int):
        """Reward, reference/critic/old-log-prob passes (overlapped with scoring) and advantages."""
        c, a = self.c, self.cfg.algorithm
        mine = _my_share(samples, self.dims, paired=a.offline_pairs)
        local = [samples[i] for i in mine]
        handle = share = None
        if scores is None and c.rewards is not None:
            handle, share = self._submit_scores(samples)
        budget, temp = self.cfg.trainer.micro_batch_tokens, self.cfg.rollout.temperature
        old = None  # None: the update's own forward pass gives them (see AlgorithmConfig.old_logp_from_update)
        if not a.old_logp_from_update:
            with self._phase("old_logp"):
                old = logprobs_pass(c.actor.module, local, temperature=temp, budget=budget)
        ref = values = rm = None
        if c.reference is not None:
            with self._phase("reference"), self._resident("reference", c.reference.module):
                ref = logprobs_pass(c.reference.module, local, temperature=temp, budget=budget)
        elif a.use_reference and is_lora(c.actor.module):
            with self._phase("reference"), adapter_disabled(c.actor.module):
                ref = logprobs_pass(c.actor.module, local, temperature=temp, budget=budget)
        if c.critic is not None:
            with self._phase("critic"), self._resident("critic", c.critic.module):
                values = values_pass(c.critic.module, local, budget=budget)
        if c.reward_model is not None:
            with self._phase("reward_model"), self._resident("reward_model", c.reward_model.module):
                rm = self._rm_scores(local)
        metrics = {}
        if handle is not None:
            t_wait = time.perf_counter()
            with self.timer.phase("reward_wait"):
                scored = self._collect_scores(handle, share, len(samples))
            metrics.update(_reward_metrics(scored))
            # Scoring time the step did not wait for: it ran while the model passes did.
            metrics["timing/reward_overlap_saved_s"] = max(0.0, scored.seconds - (time.perf_counter() - t_wait))
            scores = scored.total
        if scores is None:
            scores = torch.zeros(len(samples))
        if rm is not None:
            scores = scores + self.cfg.reward.model_weight * _global(rm, mine, len(samples))
        return self._advantages(samples, mine, scores, old, ref, values, metrics)

    def _advantages(self, samples, mine, scores, old, ref, values, metrics):
        a, n, width = self.cfg.algorithm, len(samples), width_of(samples)
        mask = response_mask(samples, width)
        if a.overlong_buffer:
            lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
            scores = scores + overlong_penalty(lengths, self.cfg.rollout.max_new_tokens, a.overlong_buffer,
                                               a.overlong_penalty)
        g_old = None if old is None else _global(old, mine, n, width)
        g_ref = None if ref is None else _global(ref, mine, n, width)
        kl_tok = kl(g_old, g_ref, a.kl_estimator, mask=mask) if a.kl_in_reward and g_ref is not None else None
        returns = g_values = pairs = None
        groups = [s.group for s in samples]
        if a.objective == "dpo":
            adv = torch.zeros(n, width)
            pairs = _pairs(samples, scores, groups, a.name == "online_dpo")
        elif a.advantage in ("gae", "reinforce_pp"):
            coef = self.kl_ctl.value if kl_tok is not None else 0.0
            rewards = token_rewards(scores, mask, kl_tok, coef)
            if a.advantage == "gae":
                g_values = _global(values, mine, n, width)
                adv, returns = ADVANTAGES["gae"](rewards, g_values, mask, a.gamma, a.lam)
            else:
                adv, returns = ADVANTAGES["reinforce_pp"](rewards, mask, a.gamma)
        elif a.advantage == "grpo":
            adv = ADVANTAGES["grpo"](scores, groups, mask, norm_by_std=a.norm_by_std)
        else:
            adv = ADVANTAGES[a.advantage](scores, groups, mask)
        metrics.update(_rollout_metrics(samples, scores))
        sel = torch.tensor(mine, dtype=torch.long)
        rows = lambda x: None if x is None else x[sel]  # noqa: E731
        batch = TrainBatch([samples[i] for i in mine], mask[sel], scores[sel], rows(g_old), adv[sel], rows(g_ref),
                           rows(g_values), rows(returns), _local_pairs(pairs, mine))
        return batch, metrics

    def _old_logp_metrics(self, batch: TrainBatch, sampled: bool) -> tuple[dict[str, float], float | None]:
        """Log-prob difference to the rollout (if `sampled`) and the mean KL to the reference (None without
        one), from this rank's share of the old log-probs, reduced over ranks."""
        out = _logprob_diff_metrics(batch.samples, batch.old_logp) if sampled else {}
        if batch.ref_logp is None:
            return out, None
        k = kl(batch.old_logp, batch.ref_logp, self.cfg.algorithm.kl_estimator, mask=batch.mask)
        total, count = all_reduce_sum([float((k * batch.mask).sum()), float(batch.mask.sum())])
        return out, total / max(count, 1.0)

    def _export(self) -> None:
        """The policy as a Hugging Face folder; with LoRA, merged, plus the adapter alone in export/adapter."""
        model, out = self.c.actor.module, self.out / "export"
        if not is_lora(model):
            export_hf(model, self.c.tokenizer, out, rank=self.dims.rank)
            return
        export_hf(model, self.c.tokenizer, out, rank=self.dims.rank, transform=lambda full: merge_full_state_dict(
            model, full), after=lambda full, tmp: save_adapter(model, full, _mkdir(tmp / "adapter")))

    def _rm_scores(self, local: list[Sample]) -> torch.Tensor:
        out = torch.zeros(len(local))
        with torch.no_grad():
            for mb in micro_batches(local, self.cfg.trainer.micro_batch_tokens):
                out[mb.indices] = sequence_scores(self.c.reward_model.module, mb).cpu()
        return out

    # -- bookkeeping -------------------------------------------------------------------------------

    def _resident(self, name: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        """Bring a model (with `optimizer`: and its state) in for the body and send it to `offload.<name>` after."""
        return self.c.offload.resident(name, getattr(self.cfg.offload, name), module, optimizer)

    def _schedulers_step(self, stats: dict[str, float], kl_mean: float | None) -> None:
        for m in (self.c.actor, self.c.critic):
            if m is not None and m.scheduler is not None:
                m.scheduler.step()
        if kl_mean is not None:
            stats["actor/kl_coef"] = self.kl_ctl.value
            stats["actor/kl_mean"] = kl_mean
            self.kl_ctl.update(kl_mean, self.cfg.data.prompts_per_step)

    def _track_finite(self, finite: bool, step: int) -> None:
        if finite:
            self.bad_steps = 0
            return
        self.bad_steps += 1
        self.skipped_steps += 1
        log.warning("step %d: non-finite loss or gradient norm; update skipped (%d in a row)", step, self.bad_steps)
        if self.bad_steps >= self.cfg.trainer.max_bad_steps:
            last = self.checkpointer.latest_complete()
            raise TrainingError(f"{self.bad_steps} non-finite steps in a row (trainer.max_bad_steps); stopping. "
                                f"Last good checkpoint: {last or 'none yet'}. Lower optim.lr or check the data.")

    def _engine_metrics(self) -> dict[str, float]:
        rep = self.c.engine.report
        switch = sum(v for k, v in rep.seconds.items() if k != "sync_weights")
        self.timer.add("sync", rep.seconds.get("sync_weights", 0.0))
        self.timer.add("switch", switch)
        return {"sync/bytes_per_rank": float(rep.bytes_received)}

    def _timings(self, step_s: float, samples: list[Sample]) -> dict[str, float]:
        times = self.timer.pop()
        out = {f"timing/{k}_s": v for k, v in times.items()}
        out.update(getattr(self, "_switch_metrics", {}))
        gen_tokens = sum(len(s.response_ids) for s in samples)
        all_tokens = sum(s.length for s in samples)
        out["timing/step_s"] = step_s
        out["throughput/tokens_per_s"] = all_tokens / step_s
        out["throughput/generated_tokens_per_s"] = gen_tokens / max(times.get("rollout", 0.0), 1e-9)
        out.update(self._memory_metrics())
        return out

    def _memory_metrics(self) -> dict[str, float]:
        """Each planned phase's measured peak (max over ranks) beside its prediction, and the step's peak."""
        measured, step_peak = self.peaks.pop()
        names = [p.name for p in self.plan.phases]
        peaks = all_reduce_max([measured.get(n, -1.0) for n in names] + [step_peak])
        out = {"memory/peak_gib": peaks[-1]}
        for phase, peak in zip(self.plan.phases, peaks, strict=False):
            if peak >= 0:  # phases this step ran (the rollout's includes the weight sync)
                out[f"memory/{phase.name}/peak_gib"] = peak
                out[f"memory/{phase.name}/plan_gib"] = phase.total / 2**30
        return out

    def _validate(self, step: int) -> float:
        """Mean reward of one greedy response per held-out prompt."""
        with self.c.engine.rollout_mode():
            samples = self.c.sampler.generate(self.c.val_records, n=1, step=-1, group_base=0,
                                              greedy=self.cfg.rollout.val_greedy)
        mean = float(self._score_all(samples).total.mean())
        self.val_history.append((step, mean))
        if self.metrics is not None:
            self.metrics.log(step, {"val/reward_mean": mean})
        return mean

    def save(self, step: int) -> None:
        comps = {"actor": (self.c.actor.module, self.c.actor.optimizer)}
        if self.c.critic is not None:
            comps["critic"] = (self.c.critic.module, self.c.critic.optimizer)
        shared = {"step": step, "loader": self.c.train_loader.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                  "schedulers": {k: m.scheduler.state_dict() for k, m in (("actor", self.c.actor),
                                                                          ("critic", self.c.critic))
                                 if m is not None and m.scheduler is not None},
                  "skipped_steps": self.skipped_steps, "val_history": self.val_history,
                  "config": to_dict(self.cfg)}
        rank_state = {"torch_rng": torch.get_rng_state()}
        critic = self.c.critic  # an offloaded critic comes in to be saved
        with self._resident("critic", critic.module, critic.optimizer) if critic is not None else nullcontext():
            self.checkpointer.save(step, components=comps, rank_state=rank_state, shared_state=shared)

    def _resume(self) -> int:
        if self.cfg.trainer.resume == "never":
            return 0
        comps = {"actor": (self.c.actor.module, self.c.actor.optimizer)}
        if self.c.critic is not None:
            comps["critic"] = (self.c.critic.module, self.c.critic.optimizer)
        found = self.checkpointer.resume_auto(comps)
        if found is None:
            return 0
        step, rank_state, shared = found
        self.c.train_loader.load_state_dict(shared["loader"])
        self.kl_ctl.load_state_dict(shared["kl_ctl"])
        for k, sd in shared["schedulers"].items():
            getattr(self.c, k).scheduler.load_state_dict(sd)
        self.skipped_steps = shared["skipped_steps"]
        self.val_history = [tuple(x) for x in shared["val_history"]]
        torch.set_rng_state(rank_state["torch_rng"])
        self._say(f"resumed from the checkpoint of step {step} in {self.checkpointer.root}")
        return step

    def _request_stop(self, signum, frame) -> None:
        self._stop = True

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Time a phase of the step and record its memory peak."""
        with self.timer.phase(name), self.peaks.phase(name):
            yield

    def _say(self, msg: str) -> None:
        if self.dims.is_main:
            print(msg, flush=True)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.c.rewards is not None:
            self.c.rewards.close()
        self.c.engine.close()


class _ScoreSet:
    def __init__(self, total, parts, counts):
        self.total, self.parts = total, parts
        self.errors, self.timeouts, self.seconds = counts


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _measured(metrics: dict[str, float]) -> dict[str, float]:
    """Phase -> measured peak GiB, from a step's `memory/<phase>/peak_gib` metrics."""
    return {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("memory/") and k.endswith("/peak_gib")
            and k.count("/") == 2}


def _my_share(samples: list[Sample], dims, *, paired: bool) -> list[int]:
    """This rank's training share: equal counts per rank, token sums balanced (pairs kept together)."""
    if not paired:
        return sorted(balance_across_ranks([s.length for s in samples], dims.world)[dims.rank])
    pair_lengths = [samples[i].length + samples[i + 1].length for i in range(0, len(samples), 2)]
    mine = balance_across_ranks(pair_lengths, dims.world)[dims.rank]
    return sorted(j for p in mine for j in (2 * p, 2 * p + 1))


def _global(local: torch.Tensor, mine: list[int], n: int, width: int | None = None) -> torch.Tensor:
    """Assemble rows computed on each rank's share into the whole batch (every rank gets all rows)."""
    shape = (n,) if local.dim() == 1 else (n, width)
    out = torch.zeros(shape)
    if local.dim() == 1:
        out[mine] = local
    else:
        out[mine, : local.shape[1]] = local
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out


def _preference_samples(records) -> list[Sample]:
    """Offline DPO: each preference record becomes a (chosen, rejected) pair of samples, adjacent."""
    out = []
    for i, r in enumerate(records):
        for ids in (r.chosen_ids, r.rejected_ids):
            out.append(Sample(r.prompt_ids, ids, (), False, i, r.index, {}, ""))
    return out


def _pairs(samples, scores, groups, online: bool) -> torch.Tensor:
    if online:
        return best_worst_pairs(scores, groups)
    return torch.tensor([(i, i + 1) for i in range(0, len(samples), 2)], dtype=torch.long)


def _local_pairs(pairs: torch.Tensor | None, mine: list[int]) -> torch.Tensor | None:
    """Pairs whose both members are in this rank's share, renumbered to local rows."""
    if pairs is None:
        return None
    pos = {g: j for j, g in enumerate(mine)}
    keep = [(pos[c], pos[r]) for c, r in pairs.tolist() if c in pos and r in pos]
    return torch.tensor(keep, dtype=torch.long).view(-1, 2)


def _trim_groups(kept: list[Sample], scores: torch.Tensor, target: int, n: int, world: int):
    """Keep whole groups, at most `target` samples, a count divisible by the world size."""
    groups = len(kept) // n
    limit = min(groups, target // n)
    while limit and (limit * n) % world:
        limit -= 1
    return kept[: limit * n], scores[: limit * n]


def _reward_metrics(scored: _ScoreSet) -> dict[str, float]:
    s = scored.total
    out = {"reward/mean": float(s.mean()), "reward/std": float(s.std()) if len(s) > 1 else 0.0,
           "reward/min": float(s.min()), "reward/max": float(s.max()),
           "reward/errors": scored.errors, "reward/timeouts": scored.timeouts, "timing/reward_score_s": scored.seconds}
    for name, v in scored.parts.items():
        out[f"reward/{name}/mean"] = float(v.mean())
    return out


def _logprob_diff_metrics(local: list[Sample], old: torch.Tensor) -> dict[str, float]:
    """How far the training model's log-probs (this rank's share, rows in order) are from vLLM's.

    A collective: every rank calls it (with its share, perhaps empty) or none does."""
    diffs = [abs(o - r) for i, s in enumerate(local) for o, r in zip(old[i].tolist(), s.rollout_logprobs,
                                                                      strict=False)]
    total, count = all_reduce_sum([sum(diffs), len(diffs)])
    out = {"rollout/logprob_diff_mean": total / max(count, 1),
           "rollout/logprob_diff_max": all_reduce_max([max(diffs, default=0.0)])[0]}
    return {k: v for k, v in out.items() if math.isfinite(v)}


def _rollout_metrics(samples: list[Sample], scores: torch.Tensor) -> dict[str, float]:
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    out = {"response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
           "response/clip_ratio": sum(s.truncated for s in samples) / len(samples), "reward/mean": float(scores.mean())}
    return {k: v for k, v in out.items() if math.isfinite(v)}
