"""The checkpoint engine's shared-memory ring between two real processes (what the CUDA path runs too, there
with the slots pinned): order, back-pressure, stale slots, abort, timeouts, the report and the manifest."""

import multiprocessing as mp
import time
import uuid

import pytest
import torch

from hybrid_rl.sidecar.shm_ring import (
    SHM_DIR,
    Manifest,
    RingAborted,
    RingTimeout,
    ShmRing,
    ShmSpaceError,
    layout_bucket,
    read_manifest,
    shm_free_bytes,
    write_manifest,
)
from hybrid_rl.weightsync.layout import TPSlice


def _slices(n: int, rows: int = 3, cols: int = 5) -> list[TPSlice]:
    return [TPSlice(f"w{i}", f"v{i}", f"m{i}", "column", (rows * 2, cols), 0, 0, rows, 0) for i in range(n)]


def _reader(namespace: str, entries_json: str, buckets: int, out) -> None:
    """Load every bucket in order (slowly, so the writer must wait for slots), summing what it read."""
    ring = ShmRing.open_reader(namespace, 0)
    entries = Manifest.from_json(entries_json).buckets[0]
    total = 0.0
    for seq in range(1, buckets + 1):
        slot = ring.wait_written(seq, timeout_s=30)
        time.sleep(0.02)
        total += float(sum(v.double().sum() for v in ring.views(slot, entries)))
        ring.release(seq)
    ring.write_report(7, torch.tensor([total]))
    out.put(total)


def test_writer_and_reader_in_two_processes_bounded_by_the_slots():
    ns = f"hrl-test-{uuid.uuid4().hex[:8]}"
    entries, nbytes = layout_bucket(_slices(3), torch.float32)
    assert [e.offset % 64 for e in entries] == [0, 0, 0] and nbytes == 3 * 64
    ring = ShmRing(ns, 0, slots=2, slot_bytes=nbytes, create=True)
    try:
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=_reader, args=(ns, Manifest(7, 8, [entries]).to_json(), 6, q))
        p.start()
        expected, waited = 0.0, 0.0
        for seq in range(1, 7):
            t = time.perf_counter()
            slot = ring.acquire(seq, timeout_s=60)
            waited += time.perf_counter() - t
            for v in ring.views(slot, entries):
                v.fill_(float(seq))
                expected += float(v.sum())
            ring.publish(seq)
        assert q.get(timeout=60) == expected  # every bucket read in order, none overwritten before it was read
        p.join(30)
        assert waited > 0.02, "with 2 slots the writer waits for the reader"
        assert float(ring.read_report(7)[0]) == expected
        with pytest.raises(RuntimeError, match="no verification report for weight update 8"):
            ring.read_report(8)
    finally:
        ring.close()
    assert not list(SHM_DIR.glob(ns + "-*")), "the writer removes its files"


def test_stale_slots_abort_and_timeouts():
    ns = f"hrl-test-{uuid.uuid4().hex[:8]}"
    entries, nbytes = layout_bucket(_slices(1), torch.bfloat16)
    w = ShmRing(ns, 0, slots=2, slot_bytes=nbytes, create=True)
    r = ShmRing.open_reader(ns, 0)
    try:
        assert (r.slots, r.slot_bytes) == (2, nbytes)
        for seq in (1, 2):
            w.acquire(seq, timeout_s=1)
            w.publish(seq)
        r.release(1)
        assert w.acquire(3, timeout_s=1) == 0  # slot 0 again: bucket 3 replaces consumed bucket 1
        w.publish(3)
        with pytest.raises(RuntimeError, match="holds bucket 3, expected 1"):
            r.wait_written(1, timeout_s=1)
        with pytest.raises(RingTimeout, match="did not load bucket 2"):
            w.acquire(4, timeout_s=0.2)  # slot 1 still holds unconsumed bucket 2
        with pytest.raises(RingAborted):
            w.acquire(4, timeout_s=30, aborted=lambda: True)
        w.reset()  # an abandoned update's leftovers are dropped
        assert w.acquire(4, timeout_s=1) == 1
        with pytest.raises(RingTimeout, match="did not write bucket 9"):
            r.wait_written(9, timeout_s=0.2)
        m = Manifest(3, 16, [entries, entries])
        write_manifest(w, m)
        assert read_manifest(r) == m
        with pytest.raises(ValueError, match="past the"):
            w.views(0, layout_bucket(_slices(2), torch.float32)[0])
    finally:
        r.close()
        w.close()
    assert not list(SHM_DIR.glob(ns + "-*"))


def test_a_ring_that_does_not_fit_in_dev_shm_is_one_clear_error_before_any_write():
    """tmpfs allocates on write: without the check the trainer would die with SIGBUS mid-update, with no Python
    error. The error names the size needed and the settings to change; no file is left."""
    ns = f"hrl-test-{uuid.uuid4().hex[:8]}"
    slot = shm_free_bytes() // 2 + 2**20  # three of them cannot fit
    with pytest.raises(ShmSpaceError, match=r"needs \d+ MiB of shared memory in /dev/shm.*rollout.bucket_mb or "
                                            r"sidecar.slots"):
        ShmRing(ns, 0, slots=3, slot_bytes=slot, create=True)
    assert not list(SHM_DIR.glob(ns + "*"))
