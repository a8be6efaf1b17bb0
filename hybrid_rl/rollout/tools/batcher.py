"""Tool calls from many trajectory threads, each answered on its own.

In sidecar mode every trajectory plays in its own thread against the servers; when one needs tools it hands its
calls here and waits. Each trajectory's calls run as soon as they arrive, in a thread of their own, on the runner's
shared workers (the runner bounds the calls in flight by its worker slots and starts each call's clock when a
worker takes it), and the trajectory is answered the moment its own calls are done: a slow tool of one trajectory
holds no other. `run` has the runner's signature, so the tool loop works with either.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from hybrid_rl.rollout.tools.runner import ToolRequest, ToolResult, ToolRunner


class ToolBatcher:
    def __init__(self, runner: ToolRunner):
        self.runner = runner
        self._closed = False
        self._lock = threading.Lock()
        self._waiting: set[Future] = set()

    @property
    def restarts(self) -> int:
        return self.runner.restarts

    @property
    def env_methods(self) -> set[str]:
        """The environment's methods the runner answers (the tool loop asks whether a user simulator is among them)."""
        return self.runner.env_methods

    def run(self, requests: list[ToolRequest]) -> list[ToolResult]:
        done: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool batcher is closed")
            self._waiting.add(done)

        def call() -> None:
            try:
                results = self.runner.run(requests)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting trajectory
                _settle(done, exception=e)
            else:
                _settle(done, results)

        threading.Thread(target=call, name="tool-call", daemon=True).start()
        try:
            return done.result()
        finally:
            with self._lock:
                self._waiting.discard(done)

    def close(self) -> None:
        """Stop; trajectories still waiting for tools get an error (no thread is left waiting forever)."""
        with self._lock:
            self._closed = True
            waiting = list(self._waiting)
        for f in waiting:
            _settle(f, exception=RuntimeError("the tool batcher is closed"))
        self.runner.close()


def _settle(f: Future, results: list[ToolResult] | None = None, exception: BaseException | None = None) -> None:
    """Answer `f` once (a call finishing after `close` answered it finds it settled)."""
    try:
        if exception is not None:
            f.set_exception(exception)
        else:
            f.set_result(results)
    except Exception:  # noqa: BLE001 - already settled (InvalidStateError)
        pass
