"""Multi-turn rollouts with tools, colocated: the `Sampler`'s engine driven turn by turn by the tool loop.

`rollout.tools` or `rollout.environment` set: `build` wraps the colocated `Sampler` in `MultiTurnRollout`, which
is a `RolloutWorker` like any other, so the trainer has no multi-turn branch. Each DP group plays its share of the
prompts' `n` trajectories, each at its own pace (`rollout.turn_schedule`: the in-process vLLM driven request by
request, a trajectory's next turn added the moment its tools answer), or in lockstep with
`rollout.multi_turn.schedule=lockstep` (`rollout.multi_turn.ToolLoop.run`: every turn waits for the longest
generation and the slowest tool); each request is token ids with what is left of its response budget. At `rollout.tp > 1` the ranks of
a vLLM group play the same trajectories (vLLM's external launcher needs identical requests from them): each
trajectory's tools and environment live on one rank of the group (its sample's holder), and the group exchanges
the answers (`GroupShare`: every turn in lockstep, at agreed engine-step boundaries per trajectory), so every rank
appends the same ids and adds the same requests at the same engine step.
"""

from __future__ import annotations

import time
from typing import Any

from hybrid_rl.colocated.sampler import Sampler
from hybrid_rl.data import PromptRecord
from hybrid_rl.distributed.collectives import all_gather_object
from hybrid_rl.distributed.mesh import tp_group
from hybrid_rl.rollout.agentic import AgentSetup, keep_survivors, opened, stats_of
from hybrid_rl.rollout.base import SyncReport
from hybrid_rl.rollout.environment import Opening, open_environment, trajectory_fields
from hybrid_rl.rollout.multi_turn import LoopStats, merge_parts
from hybrid_rl.rollout.sampling import request_seed
from hybrid_rl.rollout.speculative import SpecTally
from hybrid_rl.rollout.turn_schedule import ThreadedTools, TrajectorySchedule
from hybrid_rl.types import Generation, Rollout


class MultiTurnRollout:
    """The colocated rollout worker with tools (`rollout.mode=colocated` + `rollout.tools` / `rollout.environment`)."""

    def __init__(self, sampler: Sampler, tokenizer, setup: AgentSetup):
        self.sampler, self.tokenizer, self.setup = sampler, tokenizer, setup
        # TP > 1: the gloo group of this rank's vLLM TP group, for the tool answers (made now: every rank builds)
        self.group = tp_group(sampler.dims)

    def session(self, version: int | None = None):
        return self.sampler.session(version)

    def keep_room_for(self, optimizer, offload: str) -> None:
        self.sampler.keep_room_for(optimizer, offload)

    def last_sync(self) -> SyncReport:
        return self.sampler.last_sync()

    def close(self) -> None:
        self.setup.runner.close()
        self.sampler.close()

    def generate(self, records: list[PromptRecord], *, n: int, step: int, group_base: int,
                 greedy: bool = False) -> Rollout:
        """`n` trajectories per record, uid `i * n + j` and group `group_base + i` as `Sampler.generate`, less the
        infrastructure failures (the survivors renumbered 0..). Collective, in a session.

        The ranks of a TP group play the same trajectories (identical requests); trajectory uid `u` is held, as in
        `Sampler.generate`, by the group's rank `u % tp`, which also runs its tools and holds its environment."""
        s = self.sampler
        d = s.dims
        mine = [(i, j) for i in range(d.dp_rank, len(records), d.dp) for j in range(n)]
        share = GroupShare([(i * n + j) % d.tp for i, j in mine], d.tp_rank, self.group) if d.tp > 1 else None
        owned = [k for k in range(len(mine)) if share is None or share.owns(k)]
        envs: list[object | None] = [None] * len(mine)
        openings: dict[int, Opening] = {}
        for k in owned:
            i = mine[k][0]
            envs[k], openings[k] = open_environment(self.setup.environment, self.tokenizer, self.setup.suffix.tools,
                                                    records[i].fields, records[i].prompt_ids,
                                                    self.setup.max_prompt_tokens)
        if share is not None and self.setup.environment is not None:  # an environment's prompt: its owner's
            openings = share.exchange(openings, len(mine))
        trajs = [opened(openings.get(k) or Opening(records[i].prompt_ids)) for k, (i, _) in enumerate(mine)]
        seeds = [request_seed(s.seed, step, group_base + i) + j for i, j in mine]
        start = time.monotonic()
        tally = SpecTally()
        stats = self._play(trajs, envs, seeds, share, greedy, len(owned), tally)
        loop_s = time.monotonic() - start
        samples, failed = {}, set()
        for k in owned:
            (i, j), t = mine[k], trajs[k]
            fields = {**records[i].fields, **trajectory_fields(self.setup.environment, envs[k], t)}
            samples[i * n + j] = t.to_sample(i * n + j, group_base + i, records[i].index, fields)
            if t.infra_failed:
                failed.add(i * n + j)
        rollout = keep_survivors(samples, failed, len(records) * n, [stats_of(trajs[k]) for k in owned],
                                 wall=(stats.tool_seconds, loop_s))
        if s.settings.speculative:  # the ranks of a TP group play the same trajectories
            rollout.metrics.update(tally.metrics(copies=d.tp))
        return rollout

    def _play(self, trajs, envs, seeds, share, greedy: bool, owned: int, tally: SpecTally) -> LoopStats:
        """The per-trajectory schedule on an engine with a step API (`rollout.multi_turn.schedule=trajectory`), else
        the lockstep loop. The tool pool is sized from the trajectories whose tools this rank runs; `tally` counts
        the drafted and accepted tokens of every turn (`rollout.speculative`)."""
        s, setup = self.sampler, self.setup
        setup.runner.size_for(owned)
        turns = getattr(s.engine, "turns", None)
        if setup.schedule == "lockstep" or turns is None:
            sampling = s.sampling(greedy, 1)

            def generate(contexts: list[list[int]], budgets: list[int], seeds: list[int]) -> list[Generation]:
                gens = [g[0] for g in s.engine.generate(contexts, sampling, seeds, budgets)]
                tally.add(gens)
                return gens

            return setup.loop.run(trajs, envs, generate, seeds, share)
        tools = ThreadedTools(setup.runner, owned)
        try:
            schedule = TrajectorySchedule(setup.loop)
            return schedule.run(trajs, envs, turns(s.sampling(greedy, 1), tally), tools, seeds, share)
        finally:
            tools.close()


class GroupShare:
    """Colocated TP > 1 (`multi_turn.ToolShare`): trajectory `k` of the group's shared list belongs to the group's rank
    `owners[k]`; the exchange is an object all-gather over the group's ranks (a gloo group of consecutive ranks)."""

    def __init__(self, owners: list[int], tp_rank: int, group):
        self.owners, self.tp_rank, self.group = owners, tp_rank, group

    def owns(self, i: int) -> bool:
        return self.owners[i] == self.tp_rank

    def exchange(self, mine: dict[int, Any], check: int) -> dict[int, Any]:
        return merge_parts(all_gather_object((check, mine), group=self.group))
