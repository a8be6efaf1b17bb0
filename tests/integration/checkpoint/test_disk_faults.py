"""Disk faults during a save, on 2 real gloo ranks: one CheckpointError on every rank (no deadlock),
no partial directory left behind, and the previous checkpoint still intact and loadable."""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybrid_rl.checkpoint import Checkpointer, CheckpointError

from .harness import bitwise_equal, sharded_model, snapshot, spawn, train_step


class _FullDisk(io.FileIO):
    """A file on a disk that fills up: the first bytes land, then every write fails with ENOSPC."""

    def __init__(self, path: Path):
        super().__init__(path, "wb")

    def write(self, data) -> int:
        super().write(bytes(memoryview(data)[:64]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.name))


@contextmanager
def disk_full(when: Callable[[Path], bool]) -> Iterator[None]:
    """Files opened for writing whose path satisfies `when` hit ENOSPC (every writer goes through Path.open)."""
    real = Path.open

    def fake_open(self: Path, mode: str = "r", *args, **kwargs):
        return _FullDisk(self) if "w" in mode and when(self) else real(self, mode, *args, **kwargs)

    Path.open = fake_open
    try:
        yield
    finally:
        Path.open = real


@contextmanager
def read_only(directory: Path, rank: int) -> Iterator[None]:
    """`directory` made read-only. Root ignores mode bits, so for root the kernel's EACCES check on
    creating an entry is emulated (the checkpointer sees the same error either way)."""
    if rank == 0:
        directory.chmod(0o555)
    dist.barrier()
    real = Path.mkdir

    def checked_mkdir(self: Path, *args, **kwargs):
        if not self.exists() and not os.stat(self.parent).st_mode & stat.S_IWUSR:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *args, **kwargs)

    if os.geteuid() == 0:
        Path.mkdir = checked_mkdir
    try:
        yield
    finally:
        Path.mkdir = real
        dist.barrier()
        if rank == 0:
            directory.chmod(0o755)


def _save_error(ck: Checkpointer, comps: dict) -> dict | None:
    try:
        ck.save(2, components=comps, rank_state={"position": 2}, shared_state={"step": 2})
    except BaseException as e:  # recorded, whatever it is: the test asserts the type
        return {"type": type(e).__name__, "message": str(e)}
    return None


def _scenario(rank: int, world: int, rec: dict, model_dir: str, root: str) -> None:
    model, opt = sharded_model(model_dir, world)
    comps = {"policy": (model, opt)}
    ck = Checkpointer(root, keep_last=3, rank=rank, world=world)
    train_step(model, opt, seed=1)
    ck.save(1, components=comps, rank_state={"position": 1}, shared_state={"step": 1})
    saved = snapshot(model, opt)
    train_step(model, opt, seed=2)

    with read_only(ck.root, rank):
        rec["read_only"] = _save_error(ck, comps)
    with disk_full(lambda p: rank == 1 and p.suffix == ".distcp"):
        rec["enospc_shard"] = _save_error(ck, comps)
    dist.barrier()
    rec["after_shard_fault"] = sorted(os.listdir(root))
    with disk_full(lambda p: rank == 1 and p.name == "rank1.pt"):
        rec["enospc_rank_file"] = _save_error(ck, comps)
    dist.barrier()
    rec["after_rank_file_fault"] = sorted(os.listdir(root))

    rank_state, shared_state = ck.load(ck.latest_complete(), components=comps)
    rec["previous_loaded"] = (bitwise_equal(snapshot(model, opt), saved), rank_state, shared_state)
    train_step(model, opt, seed=3)
    rec["next_save"] = ck.save(2, components=comps, rank_state={}, shared_state={}).name


@pytest.fixture(scope="module")
def ranks(untied_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("faults") / "run"
    return spawn(_scenario, untied_model, str(root))


@pytest.mark.parametrize(("fault", "cause"), [
    ("read_only", "Permission denied"),
    ("enospc_shard", "No space left on device"),
    ("enospc_rank_file", "No space left on device"),
])
def test_disk_fault_raises_one_checkpoint_error_on_every_rank(ranks, fault, cause):
    for r in (0, 1):
        error = ranks[r][fault]
        assert error is not None and error["type"] == CheckpointError.__name__, f"rank {r}: {error}"
        assert "step_2.tmp" in error["message"] and cause in error["message"]
    assert ranks[0][fault]["message"] == ranks[1][fault]["message"], "every rank reports the same error"


def test_failed_save_leaves_no_partial_directory(ranks):
    assert ranks[0]["after_shard_fault"] == ["step_1"]
    assert ranks[0]["after_rank_file_fault"] == ["step_1"]


def test_previous_checkpoint_stays_intact_and_loadable(ranks):
    for r in (0, 1):
        restored, rank_state, shared_state = ranks[r]["previous_loaded"]
        assert restored and rank_state == {"position": 1} and shared_state == {"step": 1}


def test_saving_works_again_after_a_fault(ranks):
    assert ranks[0]["next_save"] == ranks[1]["next_save"] == "step_2"


def test_keep_last_below_one_is_refused_with_a_fix(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        Checkpointer(tmp_path, keep_last=0, rank=0, world=1)


def test_component_name_that_is_not_a_plain_directory_name_is_refused(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=1, rank=0, world=1)
    with pytest.raises(ValueError, match="'policy/v1'.*letters, digits"):
        ck.save(1, components={"policy/v1": (torch.nn.Linear(2, 2), None)}, rank_state={}, shared_state={})
