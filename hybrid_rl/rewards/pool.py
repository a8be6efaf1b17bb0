"""Score batches in worker processes while the trainer runs model passes.

``RewardPool(rubric, num_workers)`` starts ``num_workers`` spawned processes once (``spawn`` or
``forkserver``: forking after torch.distributed / vLLM have started threads is unsafe). Each worker
gets the rubric at start-up and warms it up (sympy's ~1 s import happens then, not during a step).
``submit`` returns at once; ``handle.result(timeout)`` gives a ``ScoreResult``. Samples travel in
chunks (a few per worker and batch), so the inter-process cost is paid per chunk, not per sample.

Bounds: each reward call is limited to ``timeout_s`` inside the worker (it then scores 0 and
counts as a timeout). A sample a worker is still on after ``hard_timeout_s`` (stuck in C code, say)
counts as a timeout, the pool's processes are killed and replaced, and the other unfinished
samples are scored again. A worker that dies is replaced the same way. A death takes down every chunk
in flight. The progress board names the sample the dead worker was on: it is scored again alone
(nothing else in flight), the other unfinished samples go back to the queue. Where the board cannot
tell (a worker that died between samples), every unfinished sample is a suspect and is scored again
alone. A sample that has killed its worker twice (named by the board, or while running alone) counts
as an error. ``num_workers=0`` scores inline in ``submit`` (for debugging).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.connection
import pickle
import queue
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from hybrid_rl.rewards import _pool_worker
from hybrid_rl.rewards.rubric import RewardFailure, Rubric, SampleScore, ScoreResult

__all__ = ["RewardPool", "ScoringHandle"]

_MAX_DEATHS = 2  # a sample known to have killed its worker this often is scored 0 as an error
_POLL_S = 0.05
_CHUNKS_PER_WORKER = 4  # per batch: few enough to amortise the IPC, enough to balance the load
_MAX_CHUNK = 64


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawned children re-import the parent's ``__main__`` (the trainer entry, which imports torch).
    Workers need none of it: show them an empty ``__main__`` while they start."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _stop_workers(executor: ProcessPoolExecutor, *, grace_s: float) -> None:
    """Shut ``executor`` down: give its workers ``grace_s`` to exit, SIGKILL the rest, reap them all.

    There is no public API for the worker processes before Python 3.14. The executor's manager thread
    reaps them at the same time as we do, and a process still counts as alive until one of the two
    has recorded its exit code, so wait for that thread too: afterwards no worker is left behind.
    """
    processes = list((getattr(executor, "_processes", None) or {}).values())
    manager = getattr(executor, "_executor_manager_thread", None)
    executor.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if _running(process):
            process.kill()
            process.join(5)
    if manager is not None:
        manager.join(5)


def _running(process: Any) -> bool:
    """Whether the process has not exited yet. Its sentinel says so at once; ``exitcode`` stays None
    until whichever thread reaps the process has stored the code (see ``_exit_code``)."""
    return not multiprocessing.connection.wait([process.sentinel], timeout=0)


def _exit_code(process: Any, wait_s: float = 1.0) -> int | None:
    """Exit code of a process that has exited, None while it runs. The executor's thread reaps its
    workers too, and until it has stored the code the process reads as running: wait for that."""
    if _running(process):
        return None
    deadline = time.monotonic() + wait_s
    while (code := process.exitcode) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return code


@dataclass(frozen=True)
class _Sent:
    """A chunk in flight: its samples, the executor it went to, and whether it was sent alone."""

    indices: tuple[int, ...]
    executor: ProcessPoolExecutor
    alone: bool


@dataclass
class _Batch:
    """State of one batch in the dispatcher: chunks to send, chunks in flight, samples scored.

    ``suspects`` may have killed a worker; each runs alone (a chunk in flight records whether it was
    sent alone) until it scores or has killed its worker ``_MAX_DEATHS`` times. ``dead_on`` keeps,
    per broken executor, the samples its dead workers were scoring (read once, before it is replaced).
    """

    responses: list[str]
    samples: list[Mapping[str, Any]]
    chunk_size: int
    pending: collections.deque[tuple[int, ...]] = field(default_factory=collections.deque)
    inflight: dict[Future[list[SampleScore]], _Sent] = field(default_factory=dict)
    scored: dict[int, SampleScore] = field(default_factory=dict)
    suspects: collections.deque[int] = field(default_factory=collections.deque)
    deaths: collections.Counter[int] = field(default_factory=collections.Counter)
    killed: set[ProcessPoolExecutor] = field(default_factory=set)  # killed by the pool itself (a stuck worker)
    dead_on: dict[ProcessPoolExecutor, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n, size = len(self.responses), self.chunk_size
        self.pending.extend(tuple(range(i, min(i + size, n))) for i in range(0, n, size))

    def fail_unfinished(self, failed: Any, message: str) -> None:
        chunks = [*self.pending, *(sent.indices for sent in self.inflight.values()), tuple(self.suspects)]
        unfinished = [i for indices in chunks for i in indices]
        self.scored.update((i, failed(i, "error", message)) for i in unfinished if i not in self.scored)


class ScoringHandle:
    """The pending result of one ``RewardPool.submit``."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._result: ScoreResult | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> ScoreResult:
        """Wait up to ``timeout`` seconds (None: no limit); TimeoutError if scoring is still running."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"reward scoring not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _finish(self, result: ScoreResult | None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._event.set()


class RewardPool:
    """Process pool for a rubric; use as a context manager or call ``close()``.

    ``timeout_s`` limits each reward call; ``hard_timeout_s`` (default: the time all rewards of one
    sample may take, plus 10 s) is when a worker still on one sample counts as stuck.
    """

    def __init__(
        self,
        rubric: Rubric,
        num_workers: int,
        *,
        timeout_s: float = 30.0,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
        hard_timeout_s: float | None = None,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"start_method must be 'spawn' or 'forkserver' (fork is unsafe here), got {start_method!r}"
            )
        self.rubric = Rubric(rubric.items, timeout_s=timeout_s)
        self.num_workers = num_workers
        self._hard_limit_s = hard_timeout_s or timeout_s * len(rubric.items) + 10.0
        self._ctx = multiprocessing.get_context(start_method)
        self._startup_timeout_s = startup_timeout_s
        self._closing = False
        self._executor: ProcessPoolExecutor | None = None
        self._jobs: queue.SimpleQueue[tuple[list[str], list[Mapping[str, Any]], ScoringHandle] | None]
        self._jobs = queue.SimpleQueue()
        if num_workers == 0:
            return
        _check_sendable(self.rubric)
        self._executor = self._start_executor()
        self._thread = threading.Thread(target=self._serve, name="reward-pool", daemon=True)
        self._thread.start()

    def submit(self, responses: Sequence[str], samples: Sequence[Mapping[str, Any]]) -> ScoringHandle:
        """Queue a batch for scoring and return at once (inline, so already done, with ``num_workers=0``)."""
        if len(responses) != len(samples):
            raise ValueError(f"{len(responses)} responses but {len(samples)} samples")
        if self._closing:
            raise RuntimeError("RewardPool is closed")
        handle = ScoringHandle()
        if self.num_workers == 0:
            handle._finish(self.rubric.score(responses, samples))
        else:
            self._jobs.put((list(responses), list(samples), handle))
        return handle

    def _start_executor(self) -> ProcessPoolExecutor:
        self._board = _pool_worker.new_board(self._ctx, self.num_workers)
        initargs = (self.rubric, self._board, self._ctx.Value("i", 0))
        executor = ProcessPoolExecutor(
            self.num_workers, mp_context=self._ctx, initializer=_pool_worker.init_worker, initargs=initargs
        )
        with _main_module_hidden():  # each submit spawns one worker until all are up
            probes = [executor.submit(_pool_worker.ready) for _ in range(self.num_workers)]
        done, pending = wait(probes, timeout=self._startup_timeout_s)
        failed = [f for f in done if f.exception() is not None]
        if pending or failed:
            _stop_workers(executor, grace_s=0.0)
            reason = failed[0].exception() if failed else f"not ready after {self._startup_timeout_s}s"
            raise RuntimeError(f"reward workers failed to start (their traceback is above): {reason}")
        return executor

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            responses, samples, handle = job
            try:
                handle._finish(self._score(responses, samples))
            except BaseException as err:  # hand any failure to the waiting trainer, keep serving
                handle._finish(None, err)

    def _score(self, responses: list[str], samples: list[Mapping[str, Any]]) -> ScoreResult:
        start = time.monotonic()
        batch = _Batch(responses, samples, self._chunk_size(len(responses)))
        while batch.pending or batch.inflight or batch.suspects:
            self._fill(batch)
            if self._closing:
                batch.fail_unfinished(self._failed, "reward pool closed")
                break
            done, _ = wait(batch.inflight, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            for future in done:
                self._collect(batch, future)
            self._reap_stuck(batch)
        return self.rubric.combine(list(batch.scored.values()), time.monotonic() - start)

    def _chunk_size(self, n: int) -> int:
        return max(1, min(_MAX_CHUNK, -(-n // (self.num_workers * _CHUNKS_PER_WORKER))))

    def _fill(self, batch: _Batch) -> None:
        """Keep two chunks per worker in flight; while there are suspects, run one of them alone (and
        send nothing beside the last one either: a death then is its own)."""
        if batch.suspects or any(sent.alone for sent in batch.inflight.values()):
            if batch.suspects and not batch.inflight and not self._closing:
                self._send(batch, (batch.suspects.popleft(),), alone=True)
            return
        while batch.pending and len(batch.inflight) < 2 * self.num_workers and not self._closing:
            self._send(batch, batch.pending.popleft())

    def _send(self, batch: _Batch, indices: tuple[int, ...], *, alone: bool = False) -> None:
        executor = self._current_executor()
        chunk = [(i, batch.responses[i], batch.samples[i]) for i in indices if i not in batch.scored]
        if not chunk:
            return
        try:
            future = executor.submit(_pool_worker.score_chunk, chunk)
        except BrokenProcessPool:  # a worker died between batches: nobody in this batch is to blame
            if alone:
                batch.suspects.appendleft(indices[0])
            else:
                batch.pending.appendleft(indices)
            self._replace_if_current(executor)
            return
        batch.inflight[future] = _Sent(indices, executor, alone)

    def _collect(self, batch: _Batch, future: Future[list[SampleScore]]) -> None:
        sent = batch.inflight.pop(future)
        indices, executor = sent.indices, sent.executor
        try:
            batch.scored.update((s.index, s) for s in future.result())
        except BrokenProcessPool:  # a worker died, or we killed a stuck one: every chunk in flight broke
            unfinished = tuple(i for i in indices if i not in batch.scored)
            if executor in batch.killed:  # our own kill: these samples are innocent
                batch.pending.appendleft(unfinished)
            elif sent.alone and unfinished:  # it ran with nothing beside it: the death is its own
                self._blame(batch, unfinished[0])
            else:
                self._sort_out(batch, executor, unfinished)
            self._replace_if_current(executor)
        except Exception as err:  # e.g. a sample that cannot be pickled
            message = f"{type(err).__name__}: {err}"[:300]
            batch.scored.update((i, self._failed(i, "error", message)) for i in indices)

    def _sort_out(self, batch: _Batch, executor: ProcessPoolExecutor, unfinished: tuple[int, ...]) -> None:
        """After a death: blame the sample the board says a dead worker was on, queue the rest again.

        Without a named sample (the board is read only while the executor is current, before its
        replacement SIGKILLs the others), every unfinished sample becomes a suspect.
        """
        if executor not in batch.dead_on and executor is self._executor:
            batch.dead_on[executor] = self._samples_of_dead_workers(executor)
        dead_on = batch.dead_on.get(executor)
        if not dead_on:
            batch.suspects.extend(unfinished)
            return
        for index in unfinished:
            if index in dead_on:
                self._blame(batch, index)
        if innocent := tuple(i for i in unfinished if i not in dead_on):
            batch.pending.appendleft(innocent)

    def _samples_of_dead_workers(self, executor: ProcessPoolExecutor) -> set[int]:
        """Samples that workers which died on their own were scoring. The executor SIGTERMs the
        survivors of a death, so that exit code says nothing."""
        processes = (getattr(executor, "_processes", None) or {}).values()
        died = {p.pid for p in processes if _exit_code(p) not in (None, -signal.SIGTERM)}
        return {row.index for row in _pool_worker.board_rows(self._board) if row.pid in died and row.index >= 0}

    def _blame(self, batch: _Batch, index: int) -> None:
        batch.deaths[index] += 1
        if batch.deaths[index] >= _MAX_DEATHS:
            batch.scored[index] = self._failed(index, "error", "worker process died while scoring")
        else:
            batch.suspects.appendleft(index)

    def _reap_stuck(self, batch: _Batch) -> None:
        stuck = [i for i in _pool_worker.stuck_samples(self._board, self._hard_limit_s) if i not in batch.scored]
        if not stuck:
            return
        for index in stuck:
            batch.scored[index] = self._failed(index, "timeout", f"worker stuck for over {self._hard_limit_s:g}s")
        batch.killed.add(self._current_executor())
        self._replace_if_current(self._current_executor())  # the chunks in flight come back broken

    def _current_executor(self) -> ProcessPoolExecutor:
        assert self._executor is not None
        return self._executor

    def _replace_if_current(self, executor: ProcessPoolExecutor) -> None:
        if executor is not self._executor:
            return
        _stop_workers(executor, grace_s=0.0)
        self._executor = self._start_executor()

    def _failed(self, index: int, kind: str, message: str) -> SampleScore:
        names = self.rubric.names
        failures = tuple(RewardFailure(index, name, kind, message) for name in names)
        return SampleScore(index, dict.fromkeys(names, 0.0), failures)

    def close(self) -> None:
        """Stop the workers (an unfinished batch ends with errors) and wait for them to exit."""
        if self._closing:
            return
        self._closing = True
        if self.num_workers == 0:
            return
        self._jobs.put(None)
        self._thread.join(timeout=30)
        _stop_workers(self._current_executor(), grace_s=10.0)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_sendable(rubric: Rubric) -> None:
    """Fail at construction, with a fix, for rewards that cannot reach a worker process."""
    for item in rubric.items:
        module = getattr(item.fn, "__module__", None) or type(item.fn).__module__
        if module == "__main__":
            raise ValueError(
                f"reward {item.name!r} is defined in __main__, which worker processes do not import: "
                "move it to an importable module and name it 'package.module:function'"
            )
    try:
        pickle.dumps(rubric)
    except Exception as err:
        raise ValueError(
            f"rubric cannot be sent to worker processes ({err}): use module-level functions or the built-in "
            "reward classes, not lambdas or closures"
        ) from err
