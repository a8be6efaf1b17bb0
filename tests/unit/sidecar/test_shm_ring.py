"""The checkpoint engine's shared-memory ring in one process: stale slots, abort, timeouts, the space check and the
manifest. (A writer and a reader in two processes: tests/integration/sidecar/test_shm_ring_processes.py.)"""

import uuid

import pytest
import torch

from hybrid_rl.sidecar.shm_ring import (
    Manifest,
    RingAborted,
    RingTimeout,
    ShmRing,
    ShmSpaceError,
    layout_bucket,
    read_manifest,
    write_manifest,
)
from hybrid_rl.utils.shm import SHM_DIR, shm_free_bytes
from hybrid_rl.weightsync.layout import TPSlice


def _slices(n: int, rows: int = 3, cols: int = 5) -> list[TPSlice]:
    return [TPSlice(f"w{i}", f"v{i}", f"m{i}", "column", (rows * 2, cols), 0, 0, rows, 0) for i in range(n)]


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
