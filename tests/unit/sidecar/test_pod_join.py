"""Joining the pod group: a member that never comes stops the others within `sidecar.pod_wait_s`, naming it.

(Gloo's own rendezvous waited past its timeout for a pod that died while starting: the trainer hung until the
job's limit instead of saying which pod was missing.)"""

import threading
import time

import pytest

from hybrid_rl.sidecar.pod_group import pod_store, wait_for_members


def test_a_pod_that_never_joins_is_named_once_the_wait_is_over():
    store = pod_store("127.0.0.1", 0, member=0, tp=1, pods=3, timeout_s=10)
    client = pod_store("127.0.0.1", store.port, member=1, tp=1, pods=3, timeout_s=10)
    client.set("joined/1", b"1")  # pod 1 came; pod 2 never does
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"after 1 s .*: pod 2 \(python -m hybrid_rl.pod"):
        wait_for_members(store, member=0, tp=1, pods=3, timeout_s=1.0)
    assert time.monotonic() - start < 5


def test_the_wait_ends_as_soon_as_every_member_is_there():
    store = pod_store("127.0.0.1", 0, member=0, tp=2, pods=2, timeout_s=10)
    late = threading.Timer(0.5, lambda: [store.set(f"joined/{m}", b"1") for m in (1, 2)])  # writer 1, then pod 1
    late.start()
    start = time.monotonic()
    wait_for_members(store, member=0, tp=2, pods=2, timeout_s=30)
    assert 0.4 < time.monotonic() - start < 5
    late.join()


def test_a_missing_writer_is_named_as_the_trainers():
    store = pod_store("127.0.0.1", 0, member=0, tp=2, pods=2, timeout_s=10)
    store.set("joined/0", b"1")  # writer 0; the receiver (member 2) marks itself; writer 1 never comes
    with pytest.raises(TimeoutError, match="the trainer's writer for TP rank 1 did not join"):
        wait_for_members(store, member=2, tp=2, pods=2, timeout_s=0.5)
