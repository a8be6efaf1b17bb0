"""Tool calls from many trajectory threads, run together: each batch goes to the runner's workers at once.

In sidecar mode every trajectory plays in its own thread against the servers; when one needs tools it hands its
calls here and waits. A dispatcher thread takes whatever calls are waiting and runs them as one batch in the tool
runner (in parallel, each bounded), so the tools of many trajectories overlap each other and the generation of all
the others. `run` has the runner's signature, so the tool loop works with either.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from hybrid_rl.rollout.tools.runner import ToolRequest, ToolResult, ToolRunner


class ToolBatcher:
    def __init__(self, runner: ToolRunner):
        self.runner = runner
        self._queue: queue.SimpleQueue[tuple[list[ToolRequest], Future] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="tool-batcher", daemon=True)
        self._thread.start()

    @property
    def restarts(self) -> int:
        return self.runner.restarts

    @property
    def env_methods(self) -> set[str]:
        """The environment's methods the runner answers (the tool loop asks whether a user simulator is among them)."""
        return self.runner.env_methods

    def run(self, requests: list[ToolRequest]) -> list[ToolResult]:
        if self._closed:
            raise RuntimeError("the tool batcher is closed")
        done: Future = Future()
        self._queue.put((requests, done))
        return done.result()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            jobs = [job]
            while True:  # everything waiting joins this batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                jobs.append(more)
            flat = [r for requests, _ in jobs for r in requests]
            try:
                results = self.runner.run(flat)
            except BaseException as e:  # noqa: BLE001 - handed to every waiting trajectory
                for _, f in jobs:
                    f.set_exception(e)
                continue
            at = 0
            for requests, f in jobs:
                f.set_result(results[at: at + len(requests)])
                at += len(requests)

    def close(self) -> None:
        """Stop; trajectories still waiting for tools get an error (no thread is left waiting forever)."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=5)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[1].set_exception(RuntimeError("the tool batcher is closed"))
        self.runner.close()
