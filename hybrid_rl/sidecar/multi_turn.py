"""Multi-turn rollouts with tools on the sidecar servers: one loop per trajectory, many in flight.

`rollout.mode=sidecar` with `rollout.tools` or `rollout.environment`: `build.py` wraps the `SidecarRollout` in
`MultiTurnSidecar`, a `StreamingRollout` like it, so the experience buffer (synchronous at `rollout.max_staleness=0`,
asynchronous above) streams whole trajectories as it streams single responses. Each submitted request becomes a
thread that plays the trajectory (`multi_turn.ToolLoop.model_turn` / `answer`): every turn is a token-in/token-out
request to `/inference/v1/generate` on the same server (the request key picks it: its prefix cache holds the
conversation), and tool calls go to a `ToolBatcher` that runs each trajectory's calls as they come and answers each
on its own, while the others keep generating. Every model token keeps the policy version that sampled it (the server's weight-version
spans of its turn), across turns and weight updates; context tokens take their turn's last version (they are not
trained).

An environment is handled as colocated (`environment.py`): made and reset with the request's row in the
trajectory's thread; its methods run in the tool runner's threads; its `reward()` is read when the trajectory
ends; a prompt its `reset` returned is the sample's (`Arrival.prompt_ids`).

A request that fails (a server lost) fails the trajectory: the buffer recovers the servers and sends it again from
its start (a new environment, reset again). A tool's infrastructure failure (or an environment that could not start)
ends the trajectory and marks its arrival; the buffer leaves it out of the batch (`rollout/infra_failed_rate`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import replace

import torch

from hybrid_rl.data import PromptRecord
from hybrid_rl.rollout.agentic import AgentSetup, keep_survivors, opened, stats_of
from hybrid_rl.rollout.base import Arrival, RolloutError, SyncReport, agent_row, prompt_of, row_fields
from hybrid_rl.rollout.environment import open_environment, trajectory_fields
from hybrid_rl.rollout.multi_turn import TURN_SEED_STRIDE
from hybrid_rl.rollout.sampling import request_seed, sample_of
from hybrid_rl.rollout.tools.batcher import ToolBatcher
from hybrid_rl.sidecar.completions import Router, drain_arrivals
from hybrid_rl.sidecar.rollout import SidecarRollout
from hybrid_rl.sidecar.versions import token_versions_of
from hybrid_rl.types import Generation, Request, Rollout, Sampling

log = logging.getLogger(__name__)
_WAIT_S = 0.02
# At close, how long to wait for the trajectory threads to end (with the servers gone each ends at its next call).
_DRAIN_S = 30.0


class MultiTurnSidecar:
    """The sidecar rollout worker with tools (`rollout.mode=sidecar` + `rollout.tools` / `rollout.environment`)."""

    def __init__(self, inner: SidecarRollout, tokenizer, setup: AgentSetup, *, max_inflight: int):
        self.inner, self.tokenizer, self.setup = inner, tokenizer, setup
        setup.runner.size_for(max_inflight)  # tool_workers=0: a worker per trajectory in flight (capped)
        self.batcher = ToolBatcher(setup.runner)
        self.loop = replace_runner(setup.loop, self.batcher)
        self._init_threads(max_inflight)

    def _init_threads(self, max_inflight: int) -> None:
        """The trajectory threads' bookkeeping (`AgentSidecar`'s too). One daemon thread per trajectory, at most
        `max_inflight` playing at once: a thread still waiting on a server or a tool when the run ends must not hold
        the process up for long (pool threads are joined at exit, unbounded), so `close` waits for them, bounded."""
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._closed = False
        self._arrived: queue.SimpleQueue[tuple[int, Arrival | None, str]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._threads: set[threading.Thread] = set()

    # -- the session and the rest: the sidecar's own ----------------------------------------------

    def session(self, version: int | None = None):
        return self.inner.session(version)

    def last_sync(self) -> SyncReport:
        return self.inner.last_sync()

    def keep_room_for(self, optimizer, offload: str) -> None:
        self.inner.keep_room_for(optimizer, offload)

    def recover(self) -> None:
        self.inner.recover()

    def in_flight(self) -> int:
        return self._in_flight

    def close(self) -> None:
        self._closed = True
        self.batcher.close()
        self.inner.close()
        self._drain()

    def _drain(self, timeout_s: float = _DRAIN_S) -> None:
        """Wait, at most `timeout_s`, for the trajectory threads still running (the servers are closed: each ends at
        its next call). A daemon thread left inside native code (torch, tokenizers) while the interpreter tears down
        can abort the process: a run's last rank once died so ("terminate called without an active exception")
        just after its final checkpoint, its episodes failing on the closed servers."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # -- streaming -------------------------------------------------------------------------------

    def submit(self, requests: list[Request], *, greedy: bool = False) -> None:
        """Start one trajectory per request and return at once. Collective (the servers are listed on rank 0)."""
        if not self.inner._active:
            raise RuntimeError("MultiTurnSidecar.submit() needs a session: use `with rollout.session():`")
        self._start(requests, greedy, self._arrived, counted=True)

    def _start(self, requests: list[Request], greedy: bool, sink: queue.SimpleQueue, *, counted: bool) -> None:
        router = self.inner._router()  # every turn's request has the trajectory's key: it sticks to one server
        sampling = self.inner._sampling(greedy)
        for r in requests:
            if counted:
                with self._lock:
                    self._in_flight += 1
            thread = threading.Thread(target=self._play, args=(r, sampling, router, sink, counted), daemon=True,
                                      name=f"trajectory-{r.key}")
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _play(self, r: Request, sampling: Sampling, router: Router, sink: queue.SimpleQueue, counted: bool) -> None:
        try:
            with self._slots:
                if self._closed:
                    raise RuntimeError("the rollout worker is closed")
                arrival, error = self._trajectory(r, sampling, router), ""
        except Exception as e:  # noqa: BLE001 - a failed request: the buffer recovers and sends it again
            arrival, error = None, f"{type(e).__name__}: {e}"
        with self._lock:
            if counted:
                self._in_flight -= 1
            self._threads.discard(threading.current_thread())
        sink.put((r.key, arrival, error))

    def _trajectory(self, r: Request, sampling: Sampling, router: Router) -> Arrival:
        spec = self.setup.environment
        env, opening = open_environment(spec, self.tokenizer, self.setup.suffix.tools, row_fields(r.row), r.prompt,
                                        self.setup.max_prompt_tokens)
        t = opened(opening)
        versions: list[torch.Tensor] = []
        generate_s = tool_s = 0.0
        client = self.inner.stream
        for turn in range(self.loop.limits.max_turns):
            if t.done:
                break
            start = time.monotonic()
            done, failed = client.run([Request(r.key, t.context, r.seed + turn * TURN_SEED_STRIDE)],
                                      replace(sampling, max_tokens=self.loop.turn_budget(t)), router,
                                      self.inner.model_name())
            generate_s += time.monotonic() - start
            if failed:
                raise RuntimeError(failed[r.key])
            g = done[r.key]
            before = len(t.response_ids)
            pending = self.loop.model_turn(t, g)
            turn_versions = token_versions_of(g, self.inner.policy_of)
            versions.append(turn_versions if turn_versions.numel() else torch.full((len(g.token_ids),), -1))
            if pending is None:
                break
            start = time.monotonic()
            self.loop.answer([t], [env], [(0, *pending)], _Discard())
            tool_s += time.monotonic() - start
            last = versions[-1][-1:] if versions[-1].numel() else torch.tensor([-1])
            versions.append(last.expand(len(t.response_ids) - before - len(g.token_ids)).clone())
        t.done = True
        gen = Generation(0, t.response_ids, t.logprobs, "length" if t.truncated else "stop")
        token_versions = torch.cat(versions) if versions else torch.zeros(0, dtype=torch.int64)
        if (token_versions < 0).any():  # the server stamped no versions: none recorded
            token_versions = torch.zeros(0, dtype=torch.int64)
        stats = dict(stats_of(t), tool_s=tool_s, generate_s=generate_s)
        return Arrival(gen, token_versions, torch.tensor(t.loss_mask, dtype=torch.bool),
                       trajectory_fields(spec, env, t), t.infra_failed, stats,
                       prompt_ids=tuple(t.prompt_ids) if opening.own_prompt else ())

    def arrivals(self) -> tuple[dict[int, Arrival], dict[int, str]]:
        return drain_arrivals(self._arrived)

    # -- whole batches (held-out validation) -----------------------------------------------------

    def generate(self, records: list[PromptRecord], *, n: int, step: int, group_base: int,
                 greedy: bool = False) -> Rollout:
        """As `SidecarRollout.generate` (rank r plays `uid % world == r`), less infrastructure failures. Collective."""
        d = self.inner.dims
        total = len(records) * n
        mine = range(d.rank, total, d.world)
        if not self.inner._active:
            raise RuntimeError("MultiTurnSidecar.generate() needs a session: use `with rollout.session():`")
        sink: queue.SimpleQueue = queue.SimpleQueue()  # its own: streamed trajectories may be in flight meanwhile
        self._start([Request(u, list(records[u // n].prompt_ids), request_seed(self.inner.seed, step,
                                                                                group_base + u // n) + u % n,
                             row=agent_row(records[u // n])) for u in mine], greedy, sink, counted=False)
        got: dict[int, Arrival] = {}
        while len(got) < len(mine):
            done, failed = drain_arrivals(sink)
            if failed:
                raise RolloutError(f"multi-turn generation failed: {next(iter(failed.values()))}")
            got.update(done)
            time.sleep(_WAIT_S)
        return keep_survivors(
            {u: sample_of(u, records[u // n], a.generation, group_base + u // n, prompt_of(a),
                          token_versions=a.token_versions, loss_mask=a.loss_mask, extra_fields=a.fields)
             for u, a in got.items()},
            {u for u, a in got.items() if a.infra_failed}, total, [a.stats for a in got.values()])


class _Discard:
    """`ToolLoop.answer` wants loop statistics; a lone trajectory keeps its own."""

    def __init__(self):
        self.per_call_seconds: list[float] = []


def replace_runner(loop, runner):
    """The tool loop with another runner (the batcher): same tokenizer, template, parser and limits."""
    return type(loop)(loop.tokenizer, loop.suffix, loop.parser, runner, loop.limits)
