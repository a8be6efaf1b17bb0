"""``_time_limit.time_limit``: interrupts pure-Python work in the main thread and in other threads."""

import signal
import threading
import time

import pytest

from hybrid_rl.rewards._time_limit import time_limit

# pytest-timeout arms SIGALRM's interval timer; timeout(0) switches it off for a test.
no_outer_timer = pytest.mark.timeout(0)


def _spin_swallowing_exceptions() -> None:
    while True:
        try:
            sum(range(1000))
        except Exception:  # library code often does this: the limit must still get through
            pass


@no_outer_timer
def test_main_thread_loop_is_interrupted():
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
    start = time.monotonic()
    with time_limit(0.2) as limit:
        _spin_swallowing_exceptions()
    assert limit.expired
    assert time.monotonic() - start < 1.0


@no_outer_timer
def test_main_thread_sleep_is_interrupted():
    start = time.monotonic()
    with time_limit(0.2) as limit:
        time.sleep(10)
    assert limit.expired and time.monotonic() - start < 1.0


def test_a_later_timer_armed_before_is_restored_afterwards():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 100)
    try:
        with time_limit(0.2) as limit:
            time.sleep(10)
        assert limit.expired and not fired
        assert 90 < signal.getitimer(signal.ITIMER_REAL)[0] < 100
        assert signal.getsignal(signal.SIGALRM) is not limit._on_alarm
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_sooner_timer_armed_before_still_fires():
    fired = []

    def handler(*_):
        fired.append(1)
        raise TimeoutError

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(TimeoutError), time_limit(5.0) as limit:
            time.sleep(3)
        assert fired and not limit.expired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_worker_thread_loop_is_interrupted():
    outcome = {}

    def work():
        with time_limit(0.2) as limit:
            _spin_swallowing_exceptions()
        outcome["expired"] = limit.expired

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(5)
    assert outcome == {"expired": True}


def test_block_that_finishes_in_time_is_not_marked_expired():
    with time_limit(1.0) as limit:
        value = sum(range(100))
    assert value == 4950 and not limit.expired


def test_inner_limit_expires_without_ending_the_outer_block():
    with time_limit(2.0) as outer:
        with time_limit(0.1) as inner:
            _spin_swallowing_exceptions()
        after_inner = True
    assert inner.expired and after_inner and not outer.expired


def test_outer_expiry_passes_through_an_inner_limit():
    start = time.monotonic()
    with time_limit(0.2) as outer:
        with time_limit(30) as inner:
            _spin_swallowing_exceptions()
    assert outer.expired and not inner.expired
    assert time.monotonic() - start < 1.5


def test_exceptions_of_the_block_propagate():
    try:
        with time_limit(1.0):
            raise KeyError("x")
    except KeyError:
        pass
    else:
        raise AssertionError("KeyError swallowed")


def test_many_short_limits_leave_nothing_pending():
    for _ in range(2000):
        with time_limit(1.0):
            pass
    time.sleep(0.1)  # a stray expiry would land here
