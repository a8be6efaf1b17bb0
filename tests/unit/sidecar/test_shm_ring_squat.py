"""Rings in /dev/shm that another user prepared are refused, by the writer and by the reader (real files in /dev/shm;
the test runs as root, so it can hand a file it made to another uid, as that user would have made it)."""

import os
import stat
import uuid
from pathlib import Path

import pytest
import torch

from hybrid_rl.sidecar.shm_ring import Manifest, RingSquatted, ShmRing, layout_bucket, read_manifest, write_manifest
from hybrid_rl.utils.shm import SHM_DIR
from hybrid_rl.weightsync.layout import TPSlice

OTHER_UID = 4242  # not this process's user


def _slices() -> list[TPSlice]:
    return [TPSlice("w", "v", "m", "column", (4, 8), 0, 0, 4, 0)]


def _squat(path: Path, *, uid: int = OTHER_UID, mode: int = 0o666, size: int = 4096) -> None:
    path.write_bytes(b"\0" * size)
    os.chown(path, uid, uid)
    os.chmod(path, mode)


@pytest.fixture
def ns():
    name = f"hrl-test-squat-{uuid.uuid4().hex[:8]}"
    yield name
    for p in SHM_DIR.glob(name + "-*"):
        p.unlink()


def test_a_writer_refuses_a_ring_file_another_user_made_first(ns):
    ctl = SHM_DIR / f"{ns}-tp0-ctl"
    _squat(ctl)
    with pytest.raises(RingSquatted, match=rf"{ctl}.*owner uid {OTHER_UID}"):
        ShmRing(ns, 0, slots=2, slot_bytes=256, create=True)
    assert os.stat(ctl).st_uid == OTHER_UID, "the other user's file is left as it was"
    assert not (SHM_DIR / f"{ns}-tp0-slot0").exists(), "nothing else was created"


def test_the_writers_files_are_private_and_a_symlink_is_not_followed(ns, tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep")
    (SHM_DIR / f"{ns}-tp0-slot1").symlink_to(target)
    with pytest.raises(RingSquatted, match="slot1"):
        ShmRing(ns, 0, slots=2, slot_bytes=256, create=True)
    assert target.read_text() == "keep"
    (SHM_DIR / f"{ns}-tp0-slot1").unlink()
    ring = ShmRing(ns, 0, slots=2, slot_bytes=256, create=True)
    try:
        for p in ring.paths.values():
            if p.exists():
                st = os.lstat(p)
                assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid(), p
    finally:
        ring.close()


def test_a_reader_refuses_a_ring_of_another_user_or_readable_by_others(ns):
    for name in ("ctl", "slot0", "slot1"):
        _squat(SHM_DIR / f"{ns}-tp0-{name}", size=256 if name != "ctl" else 32)
    with pytest.raises(RingSquatted, match=rf"{ns}-tp0-ctl belongs to uid {OTHER_UID}"):
        ShmRing.open_reader(ns, 0)
    # The same files as this user's, but open to everyone: refused too (another user may have written them)
    for p in SHM_DIR.glob(ns + "-*"):
        os.chown(p, os.geteuid(), os.getegid())
    with pytest.raises(RingSquatted, match="mode 666"):
        ShmRing.open_reader(ns, 0)


def test_a_manifest_swapped_in_by_another_user_is_refused(ns):
    ring = ShmRing(ns, 0, slots=1, slot_bytes=256, create=True)
    try:
        entries, _ = layout_bucket(_slices(), torch.float32)
        write_manifest(ring, Manifest(1, 4, [entries]))
        assert read_manifest(ring).update == 1
        manifest = ring.paths["manifest"]
        manifest.unlink()
        _squat(manifest, size=0)
        manifest.write_text(Manifest(99, 4, [entries]).to_json())
        with pytest.raises(Exception, match=f"belongs to uid {OTHER_UID}"):
            read_manifest(ring)
        # a temporary name prepared by another user: the next write refuses it instead of writing through it
        manifest.unlink()
        _squat(manifest.with_name(manifest.name + ".tmp"), size=0)
        with pytest.raises(Exception, match=f"belongs to uid {OTHER_UID}"):
            write_manifest(ring, Manifest(2, 4, [entries]))
    finally:
        ring.close()
