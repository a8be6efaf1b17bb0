"""The pods' groups: control over gloo, weights over the payload group, staged through a device on GPUs.

On GPUs the weights travel over NCCL through a staging buffer on the GPU (the rings are host memory); here the
same staged path runs with a CPU staging device over gloo, between two real processes (a trainer writer and
another pod's receiver).
"""

import multiprocessing as mp
import time

import pytest
import torch

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.sidecar.pod_group import PodGroup, payload_device_for, pod_store

BUCKET = torch.arange(1000, dtype=torch.float32).to(torch.bfloat16).view(torch.uint8)


def _member(member: int, port: int, staged: bool, out) -> None:
    store = pod_store("127.0.0.1", port, member=member, tp=1, pods=2, timeout_s=60)
    group = PodGroup(store, member=member, tp=1, pods=2, timeout_s=60,
                     payload_device=torch.device("cpu") if staged else None)
    header = group.broadcast_json(0, {"update": 3} if member == 0 else None)
    data = BUCKET.clone() if member == 0 else torch.zeros_like(BUCKET)
    group.broadcast_weights(0, data)
    out.put((member, header, bool(torch.equal(data, BUCKET))))


def _run(staged: bool) -> list:
    ctx, port = mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(m, port, staged, out)) for m in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return got


def test_a_bucket_reaches_the_other_pod_directly_and_through_a_staging_device():
    for staged in (False, True):
        assert _run(staged) == [(0, {"update": 3}, True), (1, {"update": 3}, True)], staged


def test_gpus_stage_weights_on_their_own_device_and_cpus_do_not():
    assert payload_device_for(cuda=True, local_rank=2) == torch.device("cuda", 2)
    assert payload_device_for(cuda=False, local_rank=2) is None


def _idle_member(member: int, port: int, ready, out) -> None:
    """Joins within the start-up wait (5 s), then waits longer than that for the next header (an update)."""
    ready.wait()  # both imported torch: the start-up wait is for joining only
    store = pod_store("127.0.0.1", port, member=member, tp=1, pods=2, timeout_s=5)
    group = PodGroup(store, member=member, tp=1, pods=2, timeout_s=60)
    if member == 0:
        time.sleep(8)  # a training step between two updates
    try:
        out.put((member, group.broadcast_json(0, {"update": 1} if member == 0 else None)))
    except RuntimeError as e:
        out.put((member, str(e)))


def test_a_pod_waits_for_the_next_update_longer_than_the_start_up_wait():
    """`sidecar.pod_wait_s` bounds joining only; each operation has `sidecar.pod_timeout_s` (a pod idles for a step)."""
    ctx, port = mp.get_context("spawn"), free_port()
    out, ready = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_idle_member, args=(m, port, ready, out)) for m in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == [(0, {"update": 1}), (1, {"update": 1})]


def _listeners(port: int) -> set[str]:
    """The local addresses something listens on at `port` (from /proc/net/tcp and tcp6, state 0A = LISTEN)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, _, state = line.split()[1:4]
                address, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:
                    found.add(address)
    return found


def test_the_store_listens_on_the_given_address_only():
    store = pod_store("127.0.0.1", 0, member=0, tp=1, pods=2, timeout_s=10)
    assert _listeners(store.port) == {"0100007F"}, "127.0.0.1 only, not every interface"
    client = pod_store("127.0.0.1", store.port, member=1, tp=1, pods=2, timeout_s=10)
    client.set("k", "v")
    assert store.get("k") == b"v"


def _forger(port: int, size: int) -> None:
    """A pod-group writer that announces a control message of `size` bytes (and sends nothing after it)."""
    store = pod_store("127.0.0.1", port, member=0, tp=1, pods=2, timeout_s=30)
    group = PodGroup(store, member=0, tp=1, pods=2, timeout_s=30)
    group.broadcast(0, torch.tensor([size], dtype=torch.int64))
    time.sleep(2)


def test_a_header_announcing_a_huge_size_is_refused_before_any_allocation():
    ctx, port = mp.get_context("spawn"), free_port()
    forger = ctx.Process(target=_forger, args=(port, 2**50))
    forger.start()
    try:
        store = pod_store("127.0.0.1", port, member=1, tp=1, pods=2, timeout_s=30)
        group = PodGroup(store, member=1, tp=1, pods=2, timeout_s=30)
        with pytest.raises(ValueError, match=f"{2**50} bytes announced .* refused"):
            group.broadcast_json(0)
    finally:
        forger.join(60)
