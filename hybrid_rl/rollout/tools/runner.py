"""Run a turn's tool calls in parallel, each bounded: a hang, a crash or a flood costs that call only.

Function tools (`rollout.tools`, the built-in `python`, an MCP server's tools) run in worker processes started once (spawned, as the
reward pool's, with its helpers: a hidden `__main__`, workers that leave with the trainer, a kill-and-reap stop).
At most one call per worker is in flight, so each call's clock starts when it is sent:

* past `timeout_s` the worker's own limit ends a call in Python code: the model reads a timeout error;
* past `timeout_s + grace_s` (stuck in C code) the workers are killed and restarted: that call is an
  infrastructure failure, and the other calls in flight are sent again;
* a worker that dies (segfault, `os._exit`, out of memory) takes its in-flight calls with it: each of them is then
  run again alone, and one that kills its worker alone is an infrastructure failure;
* output is cut to `max_chars` inside the worker.

Environment methods (per-trajectory state) run in threads of this process under the same time limit; a thread
cannot be killed, so a method still running at `timeout_s + grace_s` (blocked in C code, where the limit cannot
reach it) is answered as an infrastructure failure and left behind in its daemon thread: its trajectory is dropped,
its instance never used again, and the rollout goes on.
"""

from __future__ import annotations

import collections
import multiprocessing
import threading
import time
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from hybrid_rl.rewards._time_limit import time_limit
from hybrid_rl.rewards.pool import _main_module_hidden, _stop_workers
from hybrid_rl.rollout.tool_calls import ToolCall
from hybrid_rl.rollout.tools import _worker
from hybrid_rl.rollout.tools._worker import ERROR, INFRA, OK, TIMEOUT, as_text, middle_cut
from hybrid_rl.rollout.tools.mcp_tools import is_mcp
from hybrid_rl.rollout.tools.spec import RESPOND, EnvReply, ToolInfraError, ToolSpec

_POLL_S = 0.02


@dataclass(frozen=True)
class ToolRequest:
    call: ToolCall
    env: Any = None  # the trajectory's environment instance (its methods are tools)


@dataclass(frozen=True)
class ToolResult:
    text: str
    status: str  # ok | error | timeout | infra
    seconds: float = 0.0
    reward: float = 0.0  # an environment's reward for this step (`EnvReply`)
    role: str = "tool"  # who answers: "tool", "user" (an environment speaking as the user), "end" (respond: None)


class ToolRunner:
    def __init__(self, tools: list[ToolSpec], env_methods: tuple[str, ...] = (), *, workers: int = 2,
                 timeout_s: float = 10.0, grace_s: float = 5.0, max_chars: int = 16384,
                 start_method: str = "spawn", startup_timeout_s: float = 120.0):
        self.tools = {t.name: t for t in tools}
        self.env_methods = set(env_methods)
        # workers=0: sized from the batch (`size_for`), one to start with
        self.auto = workers == 0
        self.workers, self.timeout_s, self.grace_s, self.max_chars = max(1, workers), timeout_s, grace_s, max_chars
        self._ctx = multiprocessing.get_context(start_method)
        self._startup_timeout_s = startup_timeout_s
        self._executor: ProcessPoolExecutor | None = None
        self.restarts = 0
        # Several threads may run calls at once (the per-trajectory schedule, the sidecar's trajectory threads):
        # the pool is made and restarted under a lock, and a call is sent only with a free worker slot, so its
        # clock starts when a worker takes it, whichever thread sent it.
        self._lock = threading.RLock()
        self._slots = threading.Semaphore(self.workers)
        self._closed = False

    def size_for(self, calls: int, cap: int = 32) -> None:
        """With `workers=0`, at least `min(calls, cap)` workers (each trajectory of a batch may have a call in flight
        at once): grown before the pool starts, or by a restart of an idle one. Never shrinks."""
        want = min(max(1, calls), cap)
        with self._lock:
            if not self.auto or want <= self.workers:
                return
            for _ in range(want - self.workers):
                self._slots.release()
            self.workers = want
            if self._executor is not None:
                _stop_workers(self._executor, grace_s=0.0)
                self._executor = None

    # -- workers ---------------------------------------------------------------------------------

    def _pool(self) -> ProcessPoolExecutor:
        with self._lock:
            return self._started_pool()

    def _started_pool(self) -> ProcessPoolExecutor:
        if self._closed:  # a thread still running calls when the runner closed must not start workers again
            raise RuntimeError("the tool runner is closed")
        if self._executor is None:
            mcp_servers = tuple(sorted({t.path for t in self.tools.values() if is_mcp(t.path)}))
            ex = ProcessPoolExecutor(self.workers, mp_context=self._ctx, initializer=_worker.init,
                                     initargs=(mcp_servers,))
            with _main_module_hidden():
                probes = [ex.submit(_worker.ready) for _ in range(self.workers)]
            done, pending = wait(probes, timeout=self._startup_timeout_s)
            if pending or any(f.exception() for f in done):
                _stop_workers(ex, grace_s=0.0)
                raise RuntimeError("tool workers failed to start (their traceback is above)")
            self._executor = ex
        return self._executor

    def _restart(self, broken: ProcessPoolExecutor | None = None) -> None:
        """Kill and forget the workers (`broken`: only if they are still the pool that failed; another thread
        may have restarted it already)."""
        with self._lock:
            if self._executor is not None and (broken is None or self._executor is broken):
                _stop_workers(self._executor, grace_s=0.0)
                self._executor = None
                self.restarts += 1

    def close(self) -> None:
        self._closed = True
        self._restart()

    # -- calls -----------------------------------------------------------------------------------

    def run(self, requests: list[ToolRequest]) -> list[ToolResult]:
        """The result of every request, in order; returns when all are answered (each within its bounds)."""
        results: list[ToolResult | None] = [None] * len(requests)
        functions, envs = [], {}
        for i, r in enumerate(requests):
            if r.call.error:
                results[i] = ToolResult(f"Error: {r.call.error}", ERROR)
            elif r.env is not None and r.call.name in self.env_methods:
                envs[i] = self._start_env_call(r.env, r.call)
            elif r.call.name in self.tools:
                functions.append(i)
            else:
                known = sorted(self.tools) + sorted(self.env_methods)
                results[i] = ToolResult(f"Error: unknown tool {r.call.name!r}; the tools are {known}", ERROR)
        if functions:
            self._run_functions(requests, functions, results)
        for i, (f, started) in envs.items():
            left = started + self.timeout_s + self.grace_s - time.monotonic()
            try:
                results[i] = f.result(timeout=max(0.0, left))
            except TimeoutError:
                results[i] = ToolResult(f"Error: the tool did not return within {self.timeout_s:g}s and was "
                                        "abandoned", INFRA, time.monotonic() - started)
        return results  # type: ignore[return-value]

    def _start_env_call(self, env: Any, call: ToolCall) -> tuple[Future, float]:
        """The call running in a daemon thread of its own (one stuck for good must not hold a pool's thread, nor
        the interpreter at exit); (its future, when it started)."""
        f: Future = Future()

        def target() -> None:
            f.set_result(self._env_call(env, call))

        threading.Thread(target=target, daemon=True, name=f"env-tool-{call.name}").start()
        return f, time.monotonic()

    def _env_call(self, env: Any, call: ToolCall) -> ToolResult:
        start = time.monotonic()
        try:
            with time_limit(self.timeout_s) as limit:
                out = getattr(env, call.name)(**call.arguments)
            if limit.expired:
                return ToolResult(f"Error: the tool timed out after {self.timeout_s:g}s", TIMEOUT,
                                  time.monotonic() - start)
            if isinstance(out, EnvReply):
                return ToolResult(middle_cut(out.content, self.max_chars), OK, time.monotonic() - start,
                                  float(out.reward), "user" if call.name == RESPOND else out.role)
            if call.name == RESPOND:  # the user simulator: a message as the user, or None to end the dialogue
                role = "end" if out is None else "user"
                return ToolResult(middle_cut(as_text(out or ""), self.max_chars), OK, time.monotonic() - start,
                                  role=role)
            status, text = OK, as_text(out)
        except ToolInfraError as e:
            status, text = INFRA, str(e)
        except Exception as e:  # noqa: BLE001 - the environment's failure goes back to the model
            status, text = ERROR, f"Error: {type(e).__name__}: {e}"
        return ToolResult(middle_cut(text, self.max_chars), status, time.monotonic() - start)

    def _run_functions(self, requests: list[ToolRequest], todo: list[int], results: list) -> None:
        queue = collections.deque(todo)
        suspects: collections.deque[int] = collections.deque()  # in flight when a worker died: each runs alone
        inflight: dict[Future, tuple[int, float, bool]] = {}  # future -> (request, sent at, alone)
        try:
            while queue or suspects or inflight:
                pool = self._pool()
                if suspects and not inflight and self._slots.acquire(blocking=False):
                    i = suspects.popleft()
                    inflight[self._send(pool, requests[i])] = (i, time.monotonic(), True)
                while not suspects and queue and self._slots.acquire(blocking=False):
                    i = queue.popleft()
                    inflight[self._send(pool, requests[i])] = (i, time.monotonic(), False)
                if not inflight:  # every worker busy with other threads' calls
                    time.sleep(_POLL_S)
                    continue
                done, _ = wait(list(inflight), timeout=_POLL_S, return_when=FIRST_COMPLETED)
                broken = False
                for f in done:
                    i, sent, alone = inflight.pop(f)
                    self._slots.release()
                    try:
                        status, text = f.result()
                        results[i] = ToolResult(text, status, time.monotonic() - sent)
                    except BrokenProcessPool:
                        broken = True
                        if alone:
                            results[i] = ToolResult("Error: the tool's worker process died", INFRA,
                                                    time.monotonic() - sent)
                        else:
                            suspects.append(i)
                    except CancelledError:  # another thread restarted the workers before this call ran: again
                        queue.appendleft(i)
                now = time.monotonic()
                stuck = [f for f, (_, sent, _) in inflight.items() if now - sent > self.timeout_s + self.grace_s]
                if broken or stuck:
                    for f in stuck:
                        i, sent, _ = inflight.pop(f)
                        self._slots.release()
                        results[i] = ToolResult(f"Error: the tool did not return within {self.timeout_s:g}s and "
                                                "was killed", INFRA, now - sent)
                    for i, _, _ in inflight.values():  # innocent bystanders: sent again (alone if a worker died)
                        (suspects if broken else queue).appendleft(i)
                        self._slots.release()
                    inflight.clear()
                    self._restart(pool)
        finally:
            for _ in inflight:  # an exception on the way out: the slots go back
                self._slots.release()

    def _send(self, pool: ProcessPoolExecutor, r: ToolRequest) -> Future:
        return pool.submit(_worker.call, self.tools[r.call.name].path, dict(r.call.arguments), self.timeout_s,
                           self.max_chars, r.call.name)
