"""Asynchronous experience: rollouts stream from the sidecar servers into a buffer while the trainer trains.

`next_batch(step)` for the batch trained at policy version v = step - 1:

1. a session brings v's weights to the servers (requests in flight are paused meanwhile and go on under
   v: partial rollouts; each token is labelled with the version that sampled it);
2. regular rounds are dispatched to fill the pipeline (`buffer.Book`, rule 1); each rank sends the
   requests of the samples it will hold;
3. poll until the book can take a batch: each rank collects its finished samples and scores them in its
   reward workers as they come; one all-reduce per poll tells every rank which samples of every live
   group are finished and scored, their rewards, and whether a request failed (then every rank
   recovers the servers together and sends its failed requests again: samples already in the buffer
   stay there); refill rounds when dynamic sampling dropped too many groups;
4. the batch: its groups renumbered in gid order (uids `0..N-1`, group = position), the scores known on
   every rank from the last poll; dropped and taken groups leave the buffer, the rest stays for later
   steps, still generating while the trainer trains this one.

A request gives one sample, or (a black-box agent's episode stitched into several trajectories,
`Arrival.earlier`) several: the last is scored, and every one is trained with the episode's score, as
consecutive uids (`Sample.part`); the poll's table says how many each request gives, so every rank
numbers them alike. Group statistics stay per request (`BatchIndex.episodes`).

Seeds, the record order and which rank generates which sample are those of the synchronous loop, so
with `max_staleness = 0` the batches are the synchronous ones sample for sample (tested). With k > 0
they depend on timing (which groups finished first, where a pause cut a response): runs are not
reproducible bit for bit, by nature.

Checkpoint: the book (live groups with their records, seeds and start versions) is shared state; each
rank saves the finished samples it holds. A resumed run scores those again, sends the unfinished ones
again (from their first token: their partial tokens were on the servers) and trains every live group
once: no finished sample is lost or repeated.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hybrid_rl.algos import groups_with_signal
from hybrid_rl.data import PromptLoader
from hybrid_rl.distributed.collectives import all_reduce
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.experience.buffer import Book, Group, Plan
from hybrid_rl.experience.scoring import Ready, Scorer
from hybrid_rl.experience.source import Experience, Session, SourceSettings, no_signal, sync_metrics
from hybrid_rl.rollout.agentic import trajectory_metrics
from hybrid_rl.rollout.base import RolloutError, StreamingRollout, agent_row, prompt_of
from hybrid_rl.rollout.exchange import gather_index
from hybrid_rl.rollout.sampling import request_seed, sample_of
from hybrid_rl.rollout.speculative import SpecTally
from hybrid_rl.types import Request, Rollout, Sample, Scores
from hybrid_rl.utils.timer import PhaseTimer

log = logging.getLogger(__name__)

POLL_S = 0.02  # while waiting for groups: how often the ranks compare what they hold (one small all-reduce)
# Channels of the per-poll status tensor [C, groups, n]; the reward functions' parts follow. _SAMPLES: the samples a
# finished request gives (1, or a black-box agent episode's trajectories).
_FINISHED, _SCORED, _INFRA, _SAMPLES, _TOTAL, _ERRORS, _TIMEOUTS, _PARTS = range(8)


@dataclass(frozen=True)
class Status:
    """What every rank knows after a poll, for the live groups in gid order."""

    gids: list[int]
    table: torch.Tensor  # [C, G, n] float64 (channels above)
    failed: int  # requests that failed on any rank
    in_flight: int
    score_s: float  # scoring seconds since the last batch, summed over ranks

    def rows(self, gids: tuple[int, ...]) -> torch.Tensor:
        where = {g: i for i, g in enumerate(self.gids)}
        return torch.tensor([where[g] for g in gids], dtype=torch.long)


class BufferedSource:
    """The experience buffer of asynchronous training (`rollout.max_staleness`, sidecar mode)."""

    def __init__(self, rollout: StreamingRollout, loader: PromptLoader, scorer: Scorer, dims: ParallelDims,
                 timer: PhaseTimer, session: Session, settings: SourceSettings):
        self.rollout, self.loader, self.scorer, self.dims = rollout, loader, scorer, dims
        self.timer, self.session, self.s = timer, session, settings
        refills = settings.max_sampling_rounds - 1 if settings.dynamic_sampling else 0
        self.book = Book(settings.prompts_per_step, settings.max_staleness, refills)
        self.held: dict[int, Sample] = {}  # key -> this rank's finished sample (uid = key, group = gid)
        self.earlier: dict[int, list[Sample]] = {}  # key -> an agent episode's trajectories before the held one
        # multi-turn: keys whose tools failed for infrastructure reasons (left out of the batch), trajectory counts
        self.infra: set[int] = set()
        self.traj_stats: dict[int, dict[str, float]] = {}
        self.spec: dict[int, tuple[int, int]] = {}  # drafted and accepted tokens of each finished request
        self.scores: dict[int, tuple[float, ...]] = {}  # key -> (total, errors, timeouts, *parts)
        self.scoring: list[tuple[object, list[int]]] = []  # pool handles in progress, with their keys
        self.score_s = 0.0
        self.resend: list[int] = []  # keys to send at the next dispatch (after a resume)
        self.failed: dict[int, str] = {}  # key -> error: this rank's requests to send again after a recovery
        self.failed_polls = 0
        self.no_signal = 0  # groups dynamic sampling dropped since the last batch

    # -- the batch -------------------------------------------------------------------------------

    def next_batch(self, step: int) -> Experience:
        v = step - 1
        with self.timer.phase("rollout"), self.session(v):
            metrics = sync_metrics(self.rollout, self.timer)
            self._dispatch_regular(v)
            t0 = time.perf_counter()
            while True:
                status = self._poll(v)
                plan = self.book.plan(v)
                if plan.refill:
                    self._send(self.book.add_round(next(self.loader), version=v, step=step, refill=True), v)
                elif plan.take is not None:
                    break
                else:
                    time.sleep(POLL_S)
            metrics["async/wait_s"] = time.perf_counter() - t0
            if not plan.take:
                raise no_signal(self.book.refills + 1)
            rounds = self.book.refills + 1
            experience = self._assemble(plan, status, v)
        experience.metrics.update(metrics)
        experience.metrics.update(self._buffer_metrics(plan, status, v))
        if self.s.dynamic_sampling:
            experience.metrics["rollout/sampling_rounds"] = float(rounds)
        self.book.consume(plan)
        return experience

    def _dispatch_regular(self, v: int) -> None:
        """Rule 1, and the samples to send again after a resume (every rank calls `submit` alike)."""
        groups = []
        while self.book.regular_room():
            groups += self.book.add_round(next(self.loader), version=v, step=v + 1, refill=False)
        self._send(groups, v, again=self.resend)
        self.resend = []

    def _send(self, groups: list[Group], v: int, *, again: list[int] = ()) -> None:
        n, d = self.s.n, self.dims
        keys = [g.gid * n + j for g in groups for j in range(n) if (g.slot * n + j) % d.world == d.rank]
        keys += list(again)
        self.rollout.submit([self._request(key) for key in keys])

    def _request(self, key: int) -> Request:
        g, j = self.book.live[key // self.s.n], key % self.s.n
        return Request(key, list(g.record.prompt_ids), request_seed(self.s.seed, g.seed_step, g.seed_group) + j,
                       affinity=g.gid, row=agent_row(g.record))  # a group on one server: its prompt in one prefix cache

    # -- polling ---------------------------------------------------------------------------------

    def _poll(self, v: int) -> Status:
        """Collect, agree (one all-reduce); recover from failed requests; resolve finished groups."""
        self._collect()
        status = self._agree()
        if status.failed:
            self._recover(status, v)
            return status
        self.failed_polls = 0
        self._resolve(status)
        return status

    def _collect(self) -> None:
        """This rank's responses since the last call join the buffer and start scoring; failures are kept."""
        arrived, failed = self.rollout.arrivals()
        self.failed.update(failed)
        new = []
        for key, a in arrived.items():
            g = self.book.live.get(key // self.s.n)
            if g is None:  # cannot happen: a group leaves the book only once all its samples arrived
                log.warning("rank %d: a response for sample %d of a group no longer in the buffer", self.dims.rank, key)
                continue
            self.held[key] = sample_of(key, g.record, a.generation, g.gid, prompt_of(a), token_versions=a.token_versions,
                                       loss_mask=a.loss_mask, extra_fields=a.fields, part=len(a.earlier))
            if a.earlier:
                self.earlier[key] = [sample_of(key, g.record, e.generation, g.gid, prompt_of(e), part=k,
                                               token_versions=e.token_versions, loss_mask=e.loss_mask,
                                               extra_fields=a.fields) for k, e in enumerate(a.earlier)]
            if a.infra_failed:
                self.infra.add(key)
            if a.stats:
                self.traj_stats[key] = dict(a.stats)
            gens = [e.generation for e in a.earlier] + [a.generation]  # an episode's turns, each drafted apart
            self.spec[key] = (sum(g.spec_drafted for g in gens), sum(g.spec_accepted for g in gens))
            new.append(key)
        self._score(new)

    def _score(self, new: list[int]) -> None:
        if new:
            self.scoring.append((self.scorer.start([self.held[k] for k in new]), new))
        waiting = []
        for handle, keys in self.scoring:
            if handle is None:
                self.scores.update((k, (0.0, 0.0, 0.0)) for k in keys)
            elif handle.done():
                self._store(handle.result(), keys)
            else:
                waiting.append((handle, keys))
        self.scoring = waiting

    def _store(self, res, keys: list[int]) -> None:
        errors, timeouts = [0.0] * len(keys), [0.0] * len(keys)
        for f in res.failures:
            if f.kind == "timeout":
                timeouts[f.index] += 1
            else:
                errors[f.index] += 1
        for i, key in enumerate(keys):
            parts = tuple(res.by_name[name][i] for name in self.scorer.part_names)
            self.scores[key] = (res.totals[i], errors[i], timeouts[i], *parts)
        self.score_s += res.elapsed_s

    def _agree(self) -> Status:
        n, gids = self.s.n, list(self.book.live)
        table = torch.zeros(_PARTS + len(self.scorer.part_names), len(gids), n, dtype=torch.float64)
        where = {g: i for i, g in enumerate(gids)}
        for key in self.held:
            row, j = where[key // n], key % n
            table[_FINISHED, row, j] = 1.0
            table[_INFRA, row, j] = float(key in self.infra)
            table[_SAMPLES, row, j] = float(1 + len(self.earlier.get(key, ())))
            if (score := self.scores.get(key)) is not None:
                table[_SCORED, row, j] = 1.0
                table[_TOTAL:, row, j] = torch.tensor(score, dtype=torch.float64)
        extra = torch.tensor([float(len(self.failed)), float(self.rollout.in_flight()), self.score_s], dtype=torch.float64)
        flat = all_reduce(torch.cat([table.flatten(), extra]))  # each sample is held by one rank: the sum assembles
        table, (num_failed, in_flight, score_s) = flat[:-3].view_as(table), flat[-3:].tolist()
        return Status(gids, table, int(num_failed), int(in_flight), score_s)

    def _recover(self, status: Status, v: int) -> None:
        """Every rank: the servers back, then this rank's failed requests sent again (their groups keep their
        start version; the samples already in the buffer stay there)."""
        failed, self.failed = self.failed, {}
        self.failed_polls += 1
        if self.failed_polls > self.s.max_restarts:
            raise RolloutError(f"generation kept failing after {self.s.max_restarts} recoveries; last errors on rank "
                               f"{self.dims.rank}: {list(failed.values())[:3]}")
        if failed:
            log.warning("rank %d: %d requests failed (%s); recovering the servers and sending them again",
                        self.dims.rank, len(failed), next(iter(failed.values())))
        self.rollout.recover()
        self._send([], v, again=sorted(failed))

    def _resolve(self, status: Status) -> None:
        """Groups whose n samples are all finished and scored get their verdict; unkept ones leave."""
        done = (status.table[_FINISHED].sum(1) == self.s.n) & (status.table[_SCORED].sum(1) == self.s.n)
        for row, gid in enumerate(status.gids):
            if done[row] and not self.book.live[gid].resolved:
                kept = not self.s.dynamic_sampling or bool(groups_with_signal(status.table[_TOTAL, row].float(),
                                                                             torch.zeros(self.s.n)).any())
                self.book.resolve(gid, kept=kept)
        for gid in self.book.drop_unkept():
            self._forget(gid)
            self.no_signal += 1

    def _forget(self, gid: int) -> None:
        for key in range(gid * self.s.n, (gid + 1) * self.s.n):
            for d in (self.held, self.earlier, self.scores, self.traj_stats, self.spec):
                d.pop(key, None)
            self.infra.discard(key)

    # -- the batch out ---------------------------------------------------------------------------

    def _assemble(self, plan: Plan, status: Status, v: int) -> Experience:
        """Collective: the taken groups as the step's batch, renumbered in gid order: each request's samples (its
        episode's trajectories, the scored one last) at consecutive uids with the request's score, less the requests
        whose infrastructure failed (out of statistics and loss)."""
        n, take = self.s.n, plan.take
        position = {gid: p for p, gid in enumerate(take)}
        rows = status.rows(take)
        t = status.table[:, rows].reshape(status.table.shape[0], len(take) * n).float()
        count = torch.where(t[_INFRA] == 0, t[_SAMPLES], 0).long()  # samples of each request, in batch order
        first = torch.cumsum(count, 0) - count  # its first sample's uid
        held = []
        for key, last in self.held.items():
            p = position.get(key // n)
            if p is not None and count[p * n + key % n]:
                start = int(first[p * n + key % n])
                held += [x.renumbered(start + x.part, p) for x in (*self.earlier.get(key, ()), last)]
        held.sort(key=lambda x: x.uid)
        size = int(count.sum())
        scores = Scores(t[_TOTAL].repeat_interleave(count),
                        {name: t[_PARTS + k].repeat_interleave(count) for k, name in enumerate(self.scorer.part_names)},
                        int(t[_ERRORS].sum()), int(t[_TIMEOUTS].sum()), status.score_s / self.dims.world)
        fields = {self.book.live[gid].record.index: self.book.live[gid].record.fields for gid in take}
        keys = [k for gid in take for k in range(gid * n, (gid + 1) * n)]
        metrics = trajectory_metrics([self.traj_stats[k] for k in keys if k in self.traj_stats])
        if self.s.speculative:
            tally = SpecTally()
            for k in (k for k in keys if k in self.spec):
                tally.count(*self.spec[k])
            metrics.update(tally.metrics())
        rollout = Rollout(held, gather_index(held, size), metrics)
        for gid in (*take, *plan.drop):
            self._forget(gid)
        self.score_s = 0.0
        return Experience(rollout, Ready(scores), fields, dict(rollout.metrics))

    def _buffer_metrics(self, plan: Plan, status: Status, v: int) -> dict[str, float]:
        """Staleness of the batch's groups (v - start version: a histogram over 0..k), and the buffer's state:
        `out_of_order_groups` counts the batch's groups that overtook an older group still in the buffer."""
        k, take = self.s.max_staleness, plan.take
        stale = torch.tensor([v - self.book.live[gid].start_version for gid in take], dtype=torch.float64)
        gone = set(take) | set(plan.drop)
        left = [gid for gid in self.book.live if gid not in gone]
        out = {f"async/staleness_groups_{d}": float((stale == d).double().mean()) for d in range(k + 1)}
        out.update({"async/staleness_groups_mean": float(stale.mean()), "async/staleness_groups_max": float(stale.max()),
                    "async/dropped_stale_groups": float(len(plan.drop)),
                    "async/dropped_no_signal_groups": float(self.no_signal),
                    "async/out_of_order_groups": float(sum(gid > left[0] for gid in take) if left else 0),
                    "async/live_groups": float(len(left)), "async/in_flight_samples": float(status.in_flight)})
        self.no_signal = 0
        return out

    # -- checkpoint ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"kind": "buffered", "book": self.book.state_dict()}

    def rank_state(self) -> dict:
        """The finished samples this rank holds, with the responses that reached it since the last poll."""
        self._collect()
        return {"held": list(self.held.values()), "earlier": [x for xs in self.earlier.values() for x in xs],
                "infra": sorted(self.infra)}

    def load_state_dict(self, state: dict, rank_state: dict) -> None:
        if state.get("kind") != "buffered":
            return  # a synchronous run's checkpoint: the buffer starts empty
        self.book.load_state_dict(state["book"])
        self.held = {s.uid: s for s in rank_state["held"]}
        self.earlier, self.infra = {}, set(rank_state.get("infra", ()))  # (absent from older checkpoints)
        for x in sorted(rank_state.get("earlier", ()), key=lambda x: x.part):
            self.earlier.setdefault(x.uid, []).append(x)
        n, d = self.s.n, self.dims
        mine = [g.gid * n + j for g in self.book.live.values() for j in range(n) if (g.slot * n + j) % d.world == d.rank]
        self.resend = [key for key in mine if key not in self.held]
        self._score(sorted(self.held))
        log.info("rank %d: experience buffer resumed with %d live groups, %d finished samples held here, %d to send "
                 "again", d.rank, len(self.book.live), len(self.held), len(self.resend))
