"""Checkpoints on node-local disks: each of 2 real gloo ranks (an FSDP2-sharded tiny model) has its own checkpoint
folder, as two nodes without a shared filesystem would. Saves commit on both, each copy holds its own rank's files
only, resume is bitwise, a save committed on one node only is never resumed from, and ranks that moved to the
other node's folder, or a node that lost its folder, stop with an error (never a silent fresh start)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybrid_rl.checkpoint import Checkpointer, CheckpointError

from .harness import bitwise_equal, sharded_model, snapshot, spawn, train_step

SHARED = {"step": 0, "config": {"algo": "grpo"}}


def _scenario(rank: int, world: int, rec: dict, model_dir: str, root: str) -> None:
    import torch.distributed as dist

    model, opt = sharded_model(model_dir, world)
    comps = {"policy": (model, opt)}
    node = Path(root) / f"node{rank}"  # this rank's own disk
    ck = Checkpointer(node / "checkpoints", keep_last=3, rank=rank, world=world)
    rec["site"] = list(ck.site().ranks)
    snaps = {}
    for step in (1, 2, 3):
        train_step(model, opt, seed=step)
        ck.save(step, components=comps, rank_state={"rank": rank, "step": step}, shared_state={**SHARED, "step": step})
        snaps[step] = snapshot(model, opt)
    rec["files"] = sorted(p.relative_to(node / "checkpoints").as_posix() for p in (node / "checkpoints/step_3").rglob("*")
                          if p.is_file())
    rec["manifest_ranks"] = json.loads((node / "checkpoints/step_3/COMPLETE").read_text())["ranks"]
    # Step 3 committed on node 0 only (node 1's copy lost its manifest): resume takes step 2, on both.
    if rank == 1:
        (node / "checkpoints/step_3/COMPLETE").unlink()
    dist.barrier()
    train_step(model, opt, seed=9)
    step, rank_state, shared = ck.resume_auto(comps)
    rec["resumed"] = (step, rank_state, shared["step"])
    rec["restored_bitwise"] = bitwise_equal(snapshot(model, opt), snaps[2])
    # The ranks swap nodes (node 1's folder for rank 0): a clear error on both, not a fresh start.
    swapped = Checkpointer(Path(root) / f"node{1 - rank}" / "checkpoints", keep_last=3, rank=rank, world=world)
    try:
        swapped.resume_auto(comps)
        rec["swap_error"] = None
    except CheckpointError as e:
        rec["swap_error"] = str(e)
    # Node 1 lost its whole checkpoint folder: an error naming what each rank holds, not a fresh start.
    if rank == 1:
        (node / "checkpoints").rename(node / "lost")
    dist.barrier()
    try:
        Checkpointer(node / "checkpoints", keep_last=3, rank=rank, world=world).resume_auto(comps)
        rec["lost_error"] = None
    except CheckpointError as e:
        rec["lost_error"] = str(e)


@pytest.fixture(scope="module")
def ranks(untied_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("node_local")
    out = spawn(_scenario, untied_model, str(root))
    shutil.rmtree(root, ignore_errors=True)
    return out


def test_each_rank_finds_it_shares_its_folder_with_nobody(ranks):
    assert ranks[0]["site"] == [0] and ranks[1]["site"] == [1]


def test_each_node_copy_holds_its_own_rank_files_and_the_shared_state(ranks):
    for r in (0, 1):
        files = ranks[r]["files"]
        assert f"step_3/rank{r}.pt" in files and f"step_3/rank{1 - r}.pt" not in files
        assert any(f.startswith(f"step_3/policy/rank{r}/") for f in files)
        assert not any(f.startswith(f"step_3/policy/rank{1 - r}/") for f in files)
        assert "step_3/shared.pt" in files and "step_3/COMPLETE" in files
        assert ranks[r]["manifest_ranks"] == [r]


def test_resume_takes_the_newest_step_complete_on_every_node_bitwise(ranks):
    for r in (0, 1):
        assert ranks[r]["resumed"] == (2, {"rank": r, "step": 2}, 2)
        assert ranks[r]["restored_bitwise"], f"rank {r}"


def test_ranks_on_the_wrong_node_stop_with_the_same_clear_error(ranks):
    assert ranks[0]["swap_error"] is not None and ranks[0]["swap_error"] == ranks[1]["swap_error"]
    assert "hold other ranks' files" in ranks[0]["swap_error"] and "same hosts" in ranks[0]["swap_error"]


def test_a_node_without_the_others_checkpoints_stops_every_rank_instead_of_starting_afresh(ranks):
    assert ranks[0]["lost_error"] is not None and ranks[0]["lost_error"] == ranks[1]["lost_error"]
    assert "no checkpoint step is intact on every rank" in ranks[0]["lost_error"]
    assert "rank 0: [3, 2, 1]; rank 1: none" in ranks[0]["lost_error"]
