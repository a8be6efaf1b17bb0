"""A hard time limit for a block of Python work, usable from any thread.

Why: sympy can run for minutes on odd model output, and rewards run both in the trainer's main
thread and in pool worker processes (and maybe in user threads). Two mechanisms, chosen per block:

- the main thread: ``SIGALRM`` from ``setitimer`` (this also breaks out of sleeps and blocking
  system calls). A timer armed before (an outer limit, pytest-timeout) that would fire later is
  put back afterwards with its remaining time; one that fires sooner is left running alone;
- anywhere else (other threads, or under a sooner outer timer): a watchdog thread raises the
  exception in the target thread with ``PyThreadState_SetAsyncExc``, which lands at the next
  bytecode boundary.

Neither can stop one long C call (a huge integer power, say): callers must bound those up front.
Until the block exits, the exception is raised again every ``_REFIRE_S`` in case library code
swallowed it with a bare ``except:``.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import signal
import threading
import time
from types import TracebackType

__all__ = ["TimeLimitExceeded", "time_limit"]

_REFIRE_S = 0.5  # rare (only if swallowed), so cleanup code after an expiry is unlikely to be hit again


class TimeLimitExceeded(BaseException):  # noqa: N818 - reads better at call sites than ...Error
    """Raised inside a limited block. A BaseException, so ``except Exception`` in libraries lets it pass."""


class time_limit:  # noqa: N801 - used like a function: ``with time_limit(1.0) as limit:``
    """Interrupt the ``with`` block after ``seconds``; afterwards ``limit.expired`` tells whether it was.

    The block's own expiry is swallowed at the end of the block; an expiry of an enclosing limit
    passes through untouched, so limits nest.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = max(float(seconds), 1e-3)
        self.expired = False
        # One class per limit: lets nested limits tell their own expiry from an outer one.
        self._exc: type[TimeLimitExceeded] = type("TimeLimitExpired", (TimeLimitExceeded,), {})
        self._done = False
        self._lock = threading.Lock()
        self._tid = threading.get_ident()
        self._use_signal = False
        self._old_handler: object = None
        self._old_timer = (0.0, 0.0)
        self._started = 0.0

    def __enter__(self) -> time_limit:
        self._old_timer = signal.getitimer(signal.ITIMER_REAL)
        self._use_signal = threading.current_thread() is threading.main_thread() and (
            self._old_timer[0] == 0 or self._old_timer[0] > self.seconds
        )
        if self._use_signal:
            self._started = time.monotonic()
            self._old_handler = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds, _REFIRE_S)
        else:
            _WATCHDOG.add(time.monotonic() + self.seconds, self)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> bool:
        while True:  # an expiry may land while we tear down: it is ours, so ignore it and retry
            try:
                self._disarm()
                break
            except self._exc:
                continue
        return et is not None and issubclass(et, self._exc)

    def _disarm(self) -> None:
        with self._lock:
            self._done = True
        if self._use_signal:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            old = self._old_handler if self._old_handler is not None else signal.SIG_DFL
            signal.signal(signal.SIGALRM, old)  # type: ignore[arg-type]
            delay, interval = self._old_timer
            if delay > 0:  # give the earlier timer back what is left of it
                remaining = delay - (time.monotonic() - self._started)
                signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3), interval)
        else:
            _set_async_exc(self._tid, None)  # drop an injection not yet delivered

    def _on_alarm(self, signum: int, frame: object) -> None:
        if not self._done:
            self.expired = True
            raise self._exc(f"time limit of {self.seconds:g}s exceeded")

    def fire(self) -> bool:
        """Inject the expiry into the limited thread (watchdog side); False once the block has ended."""
        with self._lock:
            if self._done:
                return False
            self.expired = True
            _set_async_exc(self._tid, self._exc)
            return True


def _set_async_exc(tid: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)


class _Watchdog:
    """One daemon thread for all thread-side limits: a heap of (deadline, limit)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, time_limit]] = []
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, deadline: float, limit: time_limit) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._counter), limit))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="reward-time-limit", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2]._done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, _, limit = self._heap[0]
                now = time.monotonic()
                if now < deadline:
                    self._cond.wait(deadline - now)
                    continue
                heapq.heappop(self._heap)
                if limit.fire():
                    heapq.heappush(self._heap, (now + _REFIRE_S, next(self._counter), limit))


_WATCHDOG = _Watchdog()
