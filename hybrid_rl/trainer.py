"""The RL loop. One step reads top to bottom: experience, share, model passes, advantages, update.

Every rank runs the same code (SPMD). The step's samples come from an experience source: generated now
with the step's weights (`SyncSource`), or taken from the buffer that sidecar servers fill while the
trainer trains (`BufferedSource`, asynchronous training). Every sample is held by one rank, which
scores it in its reward workers. Training units (samples, or preference
pairs) are balanced over ranks by tokens and each rank receives only its units' tokens; it runs its
model passes while the reward workers score, then computes advantages of its share from the whole
batch's scores (known on every rank) and trains it with FSDP. Weights reach vLLM at the start of
the next rollout.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from hybrid_rl.algos import AdaptiveKLController, FixedKLController
from hybrid_rl.algos.objectives import get_objective
from hybrid_rl.checkpoint import Checkpointer, export_hf
from hybrid_rl.components import Components
from hybrid_rl.distributed.collectives import all_reduce_max
from hybrid_rl.experience import batch as exp_batch
from hybrid_rl.experience import share
from hybrid_rl.experience.guard import MismatchGuard
from hybrid_rl.experience.passes import PassOutputs, logprobs_pass, scores_pass, values_pass
from hybrid_rl.experience.scoring import Pending, Ready, Scorer
from hybrid_rl.experience.sources import TrainingError, open_source
from hybrid_rl.metrics import MetricsLogger
from hybrid_rl.model.lora import adapter_disabled, is_lora, merged_stream, save_adapter
from hybrid_rl.model.routing_replay import Replay
from hybrid_rl.planner.table import render
from hybrid_rl.planner.watch import PhasePeaks, PlanWatch, peak_reading
from hybrid_rl.types import Rollout, TrainBatch
from hybrid_rl.updates import update_actor, update_critic
from hybrid_rl.utils.timer import PhaseTimer

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, c: Components):
        self.c, self.s, self.dims = c, c.settings, c.dims
        s, loop, kl = c.settings, c.settings.loop, c.settings.kl
        self.out = loop.output_dir
        self.timer, self.peaks = PhaseTimer(), PhasePeaks()
        self.plan = c.plan
        self.plan_watch = PlanWatch({p.name: p.total / 2**30 for p in c.plan.phases}, enabled=torch.cuda.is_available())
        self.startup_peak_gib: float | None = peak_reading() / 2**30  # building the models: reported with step 1
        self.kl_ctl = AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.target > 0 \
            else FixedKLController(kl.coef)
        self.checkpointer = Checkpointer(self.out / "checkpoints", keep_last=loop.keep_last, rank=c.dims.rank,
                                         world=c.dims.world)
        self.objective = get_objective(s.objective)
        self.correction = s.loss.correction
        self.loss_settings, self.updates, self.batch_settings = s.loss, s.updates, s.batch
        self.scorer = Scorer(c.rewards, c.tokenizer)
        self.source = open_source(c.rollout, c.train_loader, self.scorer, c.dims, self.timer, self._session, s.source)
        self.guard = MismatchGuard(loop.max_logprob_diff)
        self.bad_steps = self.skipped_steps = 0
        self._stop = False
        self.metrics: MetricsLogger | None = None
        self.val_history: list[tuple[int, float]] = []
        # MoE routing replay's accumulators of the step: the pass that measures the router metrics, the update's
        self.router: Replay | None = None
        self._update_replay: Replay | None = None

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> None:
        start = self._resume()
        t = self.s.loop
        self.metrics = MetricsLogger(self.out, enabled=self.dims.is_main, total_steps=t.total_steps,
                                     start_step=start + 1 if start else 0, show_progress=t.show_progress)
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        if start == 0 and self.c.val_records:
            self._validate(0)
        step = start
        for step in range(start + 1, t.total_steps + 1):
            metrics = self.step(step)
            self.metrics.log(step, metrics)
            if step == min(start + 2, t.total_steps):  # measured peaks beside the prediction, once AdamW's state exists
                self._say(render(self.plan, measured=_measured(metrics)))
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
        """One RL step:

        1. experience: `rollout.n` responses per prompt, generated now or taken from the experience buffer;
           each rank holds some samples, scored or being scored (dynamic sampling keeps groups with signal);
        2. share: training units balanced over ranks by tokens, their tokens sent to the rank that trains them;
        3. passes on the share (old log-probs, reference, critic, reward model) while the rewards are scored;
        4. advantages of the share from the whole batch's scores;
        5. update: the actor, and the critic.
        """
        t0 = time.perf_counter()
        exp = self.source.next_batch(step)
        metrics = exp.metrics
        mine = self._share(exp.rollout, exp.scoring, exp.fields)
        passes = self._passes(mine)
        batch = self._train_batch(mine, passes, exp.scoring, metrics, version=step - 1)
        stats, finite = self._update(batch)
        metrics.update(stats)
        if not self.s.offline_pairs:
            self.guard.check(metrics, step)  # before the step is logged as done or saved
        self._track_finite(finite, step)
        metrics.update(self._timings(time.perf_counter() - t0, exp.rollout))
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        return metrics

    # -- the stages ------------------------------------------------------------------------------

    def _share(self, rollout: Rollout, scoring: Pending | Ready, fields) -> share.Share:
        """This rank's units: pairs from the dataset (offline DPO), best vs worst by reward (online DPO), or samples."""
        index = rollout.index
        if self.s.offline_pairs:
            units = share.adjacent_pairs(index)
        elif self.objective.paired:
            units = share.ranked_pairs(index, scoring.result().total)
        elif self.s.passes.prefix_share:  # a group on one rank: its prompt computed once there
            units = share.groups(index, self.dims.world)
        else:
            units = share.singles(index)
        return share.make_share(rollout, units, self.dims, paired=self.objective.paired, fields_of=fields.get)

    def _passes(self, mine: share.Share) -> PassOutputs:
        c, a = self.c, self.s.passes
        budget, temp, samples, out = a.budget, a.temperature, mine.samples, PassOutputs()
        shared = a.prefix_share
        # MoE routing replay: rollout replays vLLM's routes in every policy pass (the first measures the router
        # metrics); old records the old-log-prob pass's routes, which the update then replays
        rollout, self.router = self.s.router_replay == "rollout", None
        first = Replay() if self.s.router_replay != "none" else None
        if not a.old_logp_from_update:  # else the update's own forward gives them
            with self._phase("old_logp"):
                record = [None] * len(samples) if self.s.router_replay == "old" else None
                out.old_logp = logprobs_pass(c.actor.module, samples, temperature=temp, budget=budget,
                                             replay=first if rollout else None, record=record,
                                             share=shared)
                if record is not None:
                    mine.samples[:] = samples = [replace(s, routes=r) for s, r in zip(samples, record, strict=True)]
                elif rollout:
                    self.router, first = first, None
        if c.reference is not None:
            with self._phase("reference"), self._resident("reference", c.reference.module):
                out.ref_logp = logprobs_pass(c.reference.module, samples, temperature=temp, budget=budget,
                                             replay=Replay() if rollout else None, share=shared)
        elif a.use_reference and is_lora(c.actor.module):  # the frozen base is the reference
            with self._phase("reference"), adapter_disabled(c.actor.module):
                out.ref_logp = logprobs_pass(c.actor.module, samples, temperature=temp, budget=budget,
                                             replay=Replay() if rollout else None, share=shared)
        self._update_replay = first  # the update measures what no pass did
        if c.teacher is not None:
            with self._phase("teacher"), self._resident("teacher", c.teacher.module):
                out.teacher_logp = logprobs_pass(c.teacher.module, samples, temperature=temp, budget=budget,
                                                 share=shared)
        if c.critic is not None:
            with self._phase("critic"), self._resident("critic", c.critic.module):
                out.values = values_pass(c.critic.module, samples, budget=budget, share=shared)
        if c.reward_model is not None:
            with self._phase("reward_model"), self._resident("reward_model", c.reward_model.module):
                out.rm_scores = scores_pass(c.reward_model.module, samples, budget=budget)
        return out

    def _train_batch(self, mine: share.Share, passes: PassOutputs, scoring: Pending | Ready, metrics, *,
                     version: int) -> TrainBatch:
        t_wait = time.perf_counter()
        with self.timer.phase("reward_wait"):
            scored = scoring.result()
        if self.c.rewards is not None:
            metrics.update(exp_batch.reward_metrics(scored, mine.index))
        if isinstance(scoring, Pending) and self.c.rewards is not None:
            # Scoring time the step did not wait for: it ran while the model passes did.
            metrics["timing/reward_overlap_saved_s"] = max(0.0, scored.seconds - (time.perf_counter() - t_wait))
        scores = exp_batch.outcome_scores(scored, passes, mine, self.batch_settings)
        metrics.update(exp_batch.rollout_metrics(mine.index, scores) if not self.s.offline_pairs else {})
        if mine.paired:
            metrics["train/pairs"] = float(mine.num_units)
        return exp_batch.train_batch(mine, scores, passes, self.batch_settings, kl_coef=self.kl_ctl.value,
                                     version=version)

    def _update(self, batch: TrainBatch) -> tuple[dict[str, float], bool]:
        with self.timer.phase("update"):
            with self.peaks.phase("update"):
                replay = None if self.s.router_replay == "none" else self._update_replay or Replay()
                stats, finite, seen = update_actor(self.c.actor, batch, self.objective, self.loss_settings,
                                                   self.updates, replay)
                if self.router is not None or replay is not None:  # collective: every rank has the same mode
                    stats.update((self.router or replay).metrics())
            if (critic := self.c.critic) is not None:
                with self.peaks.phase("critic_update"), self._resident("critic", critic.module, critic.optimizer):
                    cstats, cfinite = update_critic(critic, batch, value_clip=self.s.value_clip,
                                                    loss_agg=self.loss_settings.loss_agg, u=self.updates)
                stats.update(cstats)
                finite &= cfinite
        old = batch.old_logp if seen is None else seen
        if not self.s.offline_pairs:
            stats.update(exp_batch.mismatch_metrics(batch, old, self.correction,
                                                    max_staleness=self.s.source.max_staleness))
        if batch.teacher_logp is not None:
            stats.update(exp_batch.distillation_metrics(batch, old))
        kl_mean = None
        if batch.ref_logp is not None:
            kl_mean = exp_batch.kl_to_reference(batch, old, self.s.kl.estimator)
        self._schedulers_step(stats, kl_mean)
        return stats, finite

    # -- bookkeeping -------------------------------------------------------------------------------

    def _schedulers_step(self, stats: dict[str, float], kl_mean: float | None) -> None:
        for m in (self.c.actor, self.c.critic):
            if m is not None and m.scheduler is not None:
                m.scheduler.step()
        if kl_mean is not None:
            stats["actor/kl_coef"] = self.kl_ctl.value
            stats["actor/kl_mean"] = kl_mean
            self.kl_ctl.update(kl_mean, self.s.source.prompts_per_step)

    def _track_finite(self, finite: bool, step: int) -> None:
        if finite:
            self.bad_steps = 0
            return
        self.bad_steps += 1
        self.skipped_steps += 1
        log.warning("step %d: non-finite loss or gradient norm; update skipped (%d in a row)", step, self.bad_steps)
        if self.bad_steps >= self.s.loop.max_bad_steps:
            last = self.checkpointer.latest_complete()
            raise TrainingError(f"{self.bad_steps} non-finite steps in a row (trainer.max_bad_steps); stopping. "
                                f"Last good checkpoint: {last or 'none yet'}. Lower optim.lr or check the data.")

    def _timings(self, step_s: float, rollout: Rollout) -> dict[str, float]:
        times = self.timer.pop()
        out = {f"timing/{k}_s": v for k, v in times.items()}
        gen_tokens = float(rollout.index.response_lens.sum())
        out["timing/step_s"] = step_s
        out["throughput/tokens_per_s"] = float(rollout.index.lengths.sum()) / step_s
        out["throughput/generated_tokens_per_s"] = gen_tokens / max(times.get("rollout", 0.0), 1e-9)
        out.update(self._memory_metrics())
        return out

    def _memory_metrics(self) -> dict[str, float]:
        """Each planned phase's measured peak (max over ranks) beside its prediction, and the step's peak."""
        measured, step_peak = self.peaks.pop()
        if self.startup_peak_gib is not None:
            measured["startup"], self.startup_peak_gib = self.startup_peak_gib, None
        names = [p.name for p in self.plan.phases]
        peaks = all_reduce_max([measured.get(n, -1.0) for n in names] + [step_peak])
        # the phases this step ran (the rollout's includes the weight sync)
        ran = {p.name: peak for p, peak in zip(self.plan.phases, peaks, strict=False) if peak >= 0}
        out = {"memory/peak_gib": peaks[-1]}
        for phase in self.plan.phases:
            if phase.name in ran:
                out[f"memory/{phase.name}/peak_gib"] = ran[phase.name]
                out[f"memory/{phase.name}/plan_gib"] = phase.total / 2**30
        for message in self.plan_watch.check(ran):  # the same verdict on every rank (peaks are all-reduced)
            if self.dims.is_main:
                log.warning(message)
        return out

    def _validate(self, step: int) -> float:
        """Mean reward of one greedy response per held-out prompt."""
        with self.c.rollout.session(step):
            rollout = self.c.rollout.generate(self.c.val_records, n=1, step=-1, group_base=0,
                                              greedy=self.s.loop.val_greedy)
        mean = float(self.scorer.score(rollout.held, rollout.index.size).total.mean())
        self.val_history.append((step, mean))
        if self.metrics is not None:
            self.metrics.log(step, {"val/reward_mean": mean, **{f"val/{k}": v for k, v in rollout.metrics.items()}})
        return mean

    def _export(self) -> None:
        """The policy as a Hugging Face folder; with LoRA, merged, plus the adapter alone in export/adapter."""
        model, out = self.c.actor.module, self.out / "export"
        if not is_lora(model):
            export_hf(model, self.c.tokenizer, out, rank=self.dims.rank)
            return
        adapter: dict[str, torch.Tensor] = {}  # filled on rank 0 while the weights stream by
        export_hf(model, self.c.tokenizer, out, rank=self.dims.rank,
                  transform=lambda stream: merged_stream(model, stream, adapter),
                  after=lambda tmp: save_adapter(model, adapter, _mkdir(tmp / "adapter")))

    def _components(self) -> dict:
        comps = {"actor": (self.c.actor.module, self.c.actor.optimizer)}
        if self.c.critic is not None:
            comps["critic"] = (self.c.critic.module, self.c.critic.optimizer)
        return comps

    def save(self, step: int) -> None:
        schedulers = {k: m.scheduler.state_dict() for k, m in (("actor", self.c.actor), ("critic", self.c.critic))
                      if m is not None and m.scheduler is not None}
        shared = {"step": step, "loader": self.c.train_loader.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                  "schedulers": schedulers, "skipped_steps": self.skipped_steps, "val_history": self.val_history,
                  "config": dict(self.s.config), "source": self.source.state_dict(), "run_id": self.c.run_id}
        rank_state = {"torch_rng": torch.get_rng_state(), "source": self.source.rank_state()}
        with self._critic_resident():
            self.checkpointer.save(step, components=self._components(), rank_state=rank_state, shared_state=shared)

    def _resume(self) -> int:
        if self.s.loop.resume == "never":
            return 0
        with self._critic_resident():
            found = self.checkpointer.resume_auto(self._components())
        if found is None:
            return 0
        step, rank_state, shared = found
        self.c.train_loader.load_state_dict(shared["loader"])
        self.kl_ctl.load_state_dict(shared["kl_ctl"])
        for k, sd in shared["schedulers"].items():
            getattr(self.c, k).scheduler.load_state_dict(sd)
        self.skipped_steps = shared["skipped_steps"]
        self.val_history = [tuple(x) for x in shared["val_history"]]
        self.source.load_state_dict(shared.get("source", {}), rank_state.get("source", {}))
        torch.set_rng_state(rank_state["torch_rng"])
        if shared.get("run_id") and self.c.run_id and shared["run_id"] != self.c.run_id:
            log.warning("the checkpoint was written by run %s; going on as run %s (the output folder's run_id file "
                        "differs): servers of the old run are not used", shared["run_id"], self.c.run_id)
        self._say(f"resumed from the checkpoint of step {step} in {self.checkpointer.root}")
        return step

    def _critic_resident(self):
        """An offloaded critic (and its optimizer state) comes in to be saved or restored."""
        critic = self.c.critic
        return nullcontext() if critic is None else self._resident("critic", critic.module, critic.optimizer)

    def _resident(self, name: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        """Bring a model (with `optimizer`: and its state) in for the body and send it to `offload.<name>` after."""
        return self.c.offload.resident(name, self.s.offload[name], module, optimizer)

    def _request_stop(self, signum, frame) -> None:
        self._stop = True

    @contextmanager
    def _session(self, version: int) -> Iterator[None]:
        """A rollout session bringing policy `version`, its start (the weight sync) and its body measured as the
        plan's sync and rollout."""
        with ExitStack() as stack:
            with self.peaks.phase("sync"):
                stack.enter_context(self.c.rollout.session(version))
            with self.peaks.phase("rollout"):
                yield

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
        self.c.rollout.close()


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _measured(metrics: dict[str, float]) -> dict[str, float]:
    """Phase -> measured peak GiB, from a step's `memory/<phase>/peak_gib` metrics."""
    return {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("memory/") and k.endswith("/peak_gib")
            and k.count("/") == 2}
