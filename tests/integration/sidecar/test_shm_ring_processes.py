"""The checkpoint engine's shared-memory ring between two real processes (what the CUDA path runs too, there
with the slots pinned): order, back-pressure and the report."""

import multiprocessing as mp
import time
import uuid

import pytest
import torch

from hybrid_rl.sidecar.shm_ring import SHM_DIR, Manifest, ShmRing, layout_bucket
from tests.unit.sidecar.test_shm_ring import _slices


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
