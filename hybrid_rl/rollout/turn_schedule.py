"""The per-trajectory schedule of the multi-turn loop: no turn barrier.

The lockstep loop (`ToolLoop.run`) generates one turn for every active trajectory, waits for the longest, runs every
call, then waits for the slowest tool. Here the engine is driven request by request (`TurnEngine`: add a request,
advance one engine step, read the requests that finished): a trajectory whose turn finished has its calls sent to
the tools at once (`ToolPool`, each trajectory's calls on their own), and its next turn is added to the engine the
moment they are answered, while the others are still generating. The rules of a turn (parsing, limits, the ids
appended) are `ToolLoop`'s own (`model_turn`, `requests_of`, `answer_of`, `apply`), so the trained ids and loss
masks are what the lockstep loop makes of the same model turns; each request draws with its own seed
(`seed + turns * TURN_SEED_STRIDE`), so what a trajectory samples does not depend on when its tools returned.

Colocated at `rollout.tp > 1` every rank of a vLLM TP group must add the same requests at the same engine step.
The engine's steps are the same on every rank (same requests, same seeds: the same requests finish at the same
step), so which trajectories wait on tools is the same everywhere; only when a tool returns differs (it runs on
its owner rank alone). The ranks therefore take tool answers only at agreed step boundaries: every `sync_every`
engine steps while the engine is busy and some trajectory waits, and whenever the engine has nothing left to run
(then each rank waits up to `IDLE_POLL_S` for one of its own calls, and the group looks again until some rank has
an answer: small exchanges while nothing else could run, so an answer on one rank is not held up by the slow tools
of another). At each such boundary the
group exchanges the answers its owners hold (`ToolShare.exchange`: one object all-gather of the ready answers and a
fingerprint of the trajectories), every rank applies the merged answers in trajectory order and adds the same next
turns, in the same order, before the next step. No collective runs per token: at most one per `sync_every` steps,
and none while no trajectory waits on a tool.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from hybrid_rl.rollout.multi_turn import TURN_SEED_STRIDE, LoopStats, ToolLoop, ToolShare, digest
from hybrid_rl.rollout.tool_calls import ToolCall
from hybrid_rl.rollout.tools.runner import ToolRequest, ToolResult
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.types import Generation

SYNC_EVERY = 16  # TP > 1: engine steps between two agreed looks at the tools' answers
IDLE_POLL_S = 0.02  # TP > 1, the engine idle: how long a rank waits for its own answers before the group looks again


class TurnEngine(Protocol):
    """An engine driven request by request (the in-process vLLM's step API: `colocated/engine_turns.py`)."""

    def add(self, key: int, context: list[int], max_tokens: int, seed: int) -> None:
        """Queue one turn of trajectory `key`; it runs from the next step on."""

    def busy(self) -> bool:
        """Whether any added request is unfinished."""

    def step(self) -> list[tuple[int, Generation]]:
        """Advance one engine step; the turns that finished in it, as (key, generation)."""


class ToolPool(Protocol):
    """Tool calls run per trajectory, each answered on its own."""

    def submit(self, key: int, requests: list[ToolRequest]) -> None:
        """Start trajectory `key`'s calls of a turn."""

    def done(self, wait: float | None) -> dict[int, list[ToolResult]]:
        """The answered trajectories' results since the last call. `wait`: 0, return at once; None, wait for at
        least one (if any runs); else wait up to that many seconds for one."""


class ThreadedTools:
    """`ToolPool` over a `ToolRunner`: each trajectory's calls run in a thread of their own (the runner's worker
    processes and environment threads do the work; its worker slots bound how many calls run at once)."""

    def __init__(self, runner, threads: int):
        self.runner = runner
        self._threads = ThreadPoolExecutor(max(1, threads), thread_name_prefix="tool-call")
        self._answered: queue.SimpleQueue[tuple[int, list[ToolResult] | BaseException]] = queue.SimpleQueue()
        self.running = 0

    def submit(self, key: int, requests: list[ToolRequest]) -> None:
        self.running += 1

        def call() -> None:
            try:
                self._answered.put((key, self.runner.run(requests)))
            except BaseException as e:  # noqa: BLE001 - raised in the loop's thread
                self._answered.put((key, e))

        self._threads.submit(call)

    def done(self, wait: float | None) -> dict[int, list[ToolResult]]:
        out: dict[int, list[ToolResult]] = {}
        while self.running:
            try:
                key, got = (self._answered.get_nowait() if out or wait == 0 else
                            self._answered.get(timeout=wait))
            except queue.Empty:
                break
            self.running -= 1
            if isinstance(got, BaseException):
                raise got
            out[key] = got
        return out

    def close(self) -> None:
        self._threads.shutdown(wait=True)


class TrajectorySchedule:
    """Plays trajectories to their end with `ToolLoop`'s rules, each at its own pace (see the module's doc)."""

    def __init__(self, loop: ToolLoop, sync_every: int = SYNC_EVERY):
        self.loop, self.sync_every = loop, max(1, sync_every)

    def run(self, trajectories: Sequence[Trajectory], envs: Sequence[object | None], engine: TurnEngine,
            tools: ToolPool, seeds: Sequence[int], share: ToolShare | None = None) -> LoopStats:
        stats = LoopStats()
        loop = self.loop
        waiting: dict[int, tuple[list[ToolCall], bool]] = {}  # trajectory -> its turn's calls, awaiting answers

        def submit(i: int) -> None:
            t = trajectories[i]
            engine.add(i, list(t.context), loop.turn_budget(t), seeds[i] + t.turns * TURN_SEED_STRIDE)

        for i, t in enumerate(trajectories):
            if not t.done:
                submit(i)
        steps = 0
        while waiting or engine.busy():
            if engine.busy():
                start = time.monotonic()
                finished = engine.step()
                stats.generate_seconds += time.monotonic() - start
                steps += 1
                for i, g in sorted(finished, key=lambda f: f[0]):
                    if (turn := loop.model_turn(trajectories[i], g)) is None:
                        continue
                    waiting[i] = turn
                    if share is None or share.owns(i):
                        tools.submit(i, loop.requests_of(trajectories[i], envs[i], turn[0]))
                if not waiting or (share is not None and engine.busy() and steps % self.sync_every):
                    continue
            idle = not engine.busy()
            mine = any(share is None or share.owns(i) for i in waiting)
            start = time.monotonic()
            answers = tools.done(0 if not (idle and mine) else None if share is None else IDLE_POLL_S)
            if idle:
                stats.tool_seconds += time.monotonic() - start
            ready = {i: loop.answer_of(trajectories[i], waiting[i][0], waiting[i][1], res) for i, res in answers.items()}
            if share is not None:
                start = time.monotonic()
                ready = share.exchange(ready, digest(trajectories))
                if idle:
                    stats.tool_seconds += time.monotonic() - start
            for i in sorted(ready):
                calls, _ = waiting.pop(i)
                loop.apply(trajectories[i], calls, ready[i], stats)
                if not trajectories[i].done:
                    submit(i)
        for t in trajectories:
            t.done = True
        stats.turns = max((t.turns for t in trajectories), default=0)
        stats.tool_restarts = loop.runner.restarts
        return stats
