"""The sidecar's trajectory threads at close: `close` waits for those still running (bounded), so none is left inside
native code while the interpreter exits; each one that ends is forgotten, counted out of `in_flight` and reported."""

import threading
import time

from hybrid_rl.sidecar.multi_turn import MultiTurnSidecar
from hybrid_rl.types import Request


class _Inner:
    """What `_start` reads of the sidecar rollout: its router and sampling settings (neither used here)."""

    def _router(self):
        return None

    def _sampling(self, greedy):
        return None


def _worker(trajectory) -> MultiTurnSidecar:
    w = MultiTurnSidecar.__new__(MultiTurnSidecar)
    w.inner = _Inner()
    w._init_threads(max_inflight=2)
    w._trajectory = trajectory
    return w


def test_drain_waits_for_every_running_trajectory_and_forgets_it():
    servers_closed, ended = threading.Event(), []

    def trajectory(r, sampling, router):
        servers_closed.wait()  # as a call to a closed server: it fails, then the thread ends
        time.sleep(0.05)
        ended.append(r.key)
        raise ConnectionError("server closed")

    w = _worker(trajectory)
    w._start([Request(k, [1, 2], k) for k in range(5)], False, w._arrived, counted=True)
    assert w.in_flight() == 5
    servers_closed.set()
    w._drain(timeout_s=10)
    assert sorted(ended) == list(range(5)) and w.in_flight() == 0 and not w._threads
    arrived = sorted(w._arrived.get_nowait() for _ in range(5))
    assert [(k, a) for k, a, _ in arrived] == [(k, None) for k in range(5)]
    assert all("ConnectionError: server closed" in e for _, _, e in arrived)


def test_drain_gives_up_on_a_stuck_trajectory_after_its_timeout():
    stuck = threading.Event()
    w = _worker(lambda r, sampling, router: stuck.wait())
    w._start([Request(0, [1], 0)], False, w._arrived, counted=True)
    start = time.monotonic()
    w._drain(timeout_s=0.3)
    assert 0.25 <= time.monotonic() - start < 5 and w.in_flight() == 1
    stuck.set()
