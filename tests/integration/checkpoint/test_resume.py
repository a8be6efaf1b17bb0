"""Save and resume on 2 real gloo ranks with an FSDP2-sharded tiny model: exact round trip, pruning,
and damaged checkpoints skipped (never loaded) in favour of the newest intact one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybrid_rl.checkpoint import Checkpointer, CheckpointError

from .harness import Captured, bitwise_equal, sharded_model, snapshot, spawn, train_step

SHARED = {"step": 2, "scheduler": {"last_epoch": 2, "base_lrs": [0.01]}, "kl": {"beta": 0.05},
          "config": {"algo": {"name": "grpo", "clip": (0.2, 0.28)}}}


def _rank_state(rank: int, step: int) -> dict:
    return {"rng": torch.get_rng_state(), "loader": {"epoch": 0, "position": 100 * rank + step}}


def _save(ck: Checkpointer, step: int, comps: dict, rank: int) -> dict:
    rank_state = _rank_state(rank, step)
    ck.save(step, components=comps, rank_state=rank_state, shared_state={**SHARED, "step": step})
    return rank_state


def _scenario(rank: int, world: int, rec: dict, model_dirs: dict[str, str], root: str) -> None:
    model, opt = sharded_model(model_dirs["untied"], world)
    comps = {"policy": (model, opt)}
    ck = Checkpointer(Path(root) / "run", keep_last=2, rank=rank, world=world)
    rec["fresh_start"] = ck.resume_auto(comps) is None

    # Round trip: save at step 2, train on, resume.
    for step in (1, 2):
        train_step(model, opt, seed=step)
        opt.param_groups[0]["lr"] = 0.01 / step  # as a scheduler would
        saved_rank_state = _save(ck, step, comps, rank)
    saved = snapshot(model, opt)
    train_step(model, opt, seed=3)
    opt.param_groups[0]["lr"] = 0.5
    rec["trained_past_save"] = not bitwise_equal(snapshot(model, opt), saved)
    step, rank_state, shared_state = ck.resume_auto(comps)
    rec["resumed_step"] = step
    rec["restored_bitwise"] = bitwise_equal(snapshot(model, opt), saved)
    rec["rank_state"] = (torch.equal(rank_state["rng"], saved_rank_state["rng"]), rank_state["loader"])
    rec["shared_state"] = shared_state
    # A restarted run: a new model from the original weights and an optimizer that never stepped.
    fresh_model, fresh_opt = sharded_model(model_dirs["untied"], world)
    rec["fresh_resumed_step"] = ck.resume_auto({"policy": (fresh_model, fresh_opt)})[0]
    rec["fresh_restored_bitwise"] = bitwise_equal(snapshot(fresh_model, fresh_opt), saved)
    _tied_round_trip(rank, world, rec, model_dirs["tied"], Path(root) / "tied")

    train_step(model, opt, seed=4)
    _save(ck, 3, comps, rank)
    rec["kept"] = sorted(os.listdir(ck.root))

    _damaged_checkpoints(rank, world, rec, model, opt, Path(root) / "damaged")
    _replicated(rank, world, rec, model_dirs["untied"], Path(root) / "hsdp")


def _replicated(rank: int, world: int, rec: dict, model_dir: str, root: Path) -> None:
    """`trainer.shard_size=1` (HSDP: every rank holds every weight whole) trains as full sharding does, and its
    checkpoints round-trip bitwise. Each rank steps on its own batch, so the all-reduce must average them."""
    from torch.distributed.tensor import Replicate, Shard

    hsdp, hsdp_opt = sharded_model(model_dir, world, shard=1)
    full, full_opt = sharded_model(model_dir, world)
    p = next(iter(hsdp.parameters()))
    rec["hsdp_layout"] = (tuple(p.placements) == (Replicate(), Shard(0)), p.to_local().shape == p.shape)
    losses = []
    for seed in (100 + rank, 200 + rank):
        losses.append((float(train_step(hsdp, hsdp_opt, seed)), float(train_step(full, full_opt, seed))))
    rec["hsdp_losses"] = losses
    pairs = zip(hsdp.named_parameters(), full.parameters(), strict=True)
    rec["hsdp_max_weight_diff"] = max(float((a.full_tensor() - b.full_tensor()).abs().max()) for (_, a), b in pairs)
    ck = Checkpointer(root, keep_last=1, rank=rank, world=world)
    _save(ck, 1, {"policy": (hsdp, hsdp_opt)}, rank)
    saved = snapshot(hsdp, hsdp_opt)
    train_step(hsdp, hsdp_opt, seed=7)
    fresh, fresh_opt = sharded_model(model_dir, world, shard=1)
    rec["hsdp_resumed_step"] = ck.resume_auto({"policy": (fresh, fresh_opt)})[0]
    rec["hsdp_restored_bitwise"] = bitwise_equal(snapshot(fresh, fresh_opt), saved)
    # Each rank wrote every row: a run sharded over both ranks finds its rows in it.
    sharded, sharded_opt = sharded_model(model_dir, world)
    ck.load(root / "step_1", components={"policy": (sharded, sharded_opt)})
    rec["hsdp_into_sharded"] = all(torch.equal(a.full_tensor(), b.full_tensor())
                                   for a, b in zip(fresh.parameters(), sharded.parameters(), strict=True))
    # The other way round, a rank would need rows it never wrote.
    ck_full = Checkpointer(root / "full", keep_last=1, rank=rank, world=world)
    _save(ck_full, 1, {"policy": (sharded, sharded_opt)}, rank)
    try:
        ck_full.load(root / "full" / "step_1", components={"policy": (fresh, fresh_opt)})
        rec["sharded_into_hsdp"] = "loaded"
    except Exception as e:  # noqa: BLE001 - what it raises is recorded, the test checks it
        rec["sharded_into_hsdp"] = f"{type(e).__name__}: {e}"


def _tied_round_trip(rank: int, world: int, rec: dict, model_dir: str, root: Path) -> None:
    """Tied input/output embeddings (one parameter under two names) survive save and load."""
    model, opt = sharded_model(model_dir, world)
    ck = Checkpointer(root, keep_last=1, rank=rank, world=world)
    train_step(model, opt, seed=1)
    _save(ck, 1, {"policy": (model, opt)}, rank)
    saved = snapshot(model, opt)
    train_step(model, opt, seed=2)
    fresh_model, fresh_opt = sharded_model(model_dir, world)
    ck.resume_auto({"policy": (fresh_model, fresh_opt)})
    rec["tied_restored_bitwise"] = bitwise_equal(snapshot(fresh_model, fresh_opt), saved)
    rec["tied_still_tied"] = fresh_model.lm_head.weight is fresh_model.model.embed_tokens.weight


def _damaged_checkpoints(rank: int, world: int, rec: dict, model, opt, root: Path) -> None:
    """Step 10 is intact; 11..14 and 15.tmp are damaged in different ways after being saved."""
    comps = {"policy": (model, opt)}
    ck = Checkpointer(root, keep_last=10, rank=rank, world=world)
    for step in range(10, 15):
        train_step(model, opt, seed=step)
        _save(ck, step, comps, rank)
        if step == 10:
            intact = snapshot(model, opt)
    if rank == 0:
        metadata = root / "step_11/policy/rank0/.metadata"  # same size, garbled bytes: only loading can tell
        metadata.write_bytes(b"\0" * metadata.stat().st_size)
        (root / "step_12/rank1.pt").unlink()
        (root / "step_13/COMPLETE").unlink()
        shard = root / "step_14/policy/rank1/__0_0.distcp"
        os.truncate(shard, shard.stat().st_size // 2)
        (root / "step_15.tmp/policy").mkdir(parents=True)  # a save that crashed half-way
    dist.barrier()
    captured = Captured()
    rec["latest_complete"] = ck.latest_complete().name
    try:
        ck.load(root / "step_14", components=comps)
    except CheckpointError as e:
        rec["load_truncated_error"] = str(e)
    train_step(model, opt, seed=99)
    captured.messages.clear()
    step, _, shared_state = ck.resume_auto(comps)
    rec["resumed_past_damage"] = (step, shared_state["step"])
    rec["restored_intact"] = bitwise_equal(snapshot(model, opt), intact)
    rec["warnings"] = captured.messages


@pytest.fixture(scope="module")
def ranks(untied_model, tied_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("resume")
    results = spawn(_scenario, {"untied": untied_model, "tied": tied_model}, str(root))
    return {"root": root, **results}


def test_no_checkpoint_means_fresh_start(ranks):
    assert ranks[0]["fresh_start"] and ranks[1]["fresh_start"]


def test_resume_restores_params_and_optimizer_state_bitwise(ranks):
    for r in (0, 1):
        assert ranks[r]["trained_past_save"], "the extra step should have changed the weights"
        assert ranks[r]["resumed_step"] == 2
        assert ranks[r]["restored_bitwise"], f"rank {r}: params/optimizer differ from the saved ones"


def test_a_restarted_run_resumes_bitwise_into_a_new_model_and_optimizer(ranks):
    for r in (0, 1):
        assert ranks[r]["fresh_resumed_step"] == 2
        assert ranks[r]["fresh_restored_bitwise"], f"rank {r}: params/optimizer differ from the saved ones"


def test_tied_embeddings_round_trip_and_stay_tied(ranks):
    for r in (0, 1):
        assert ranks[r]["tied_restored_bitwise"] and ranks[r]["tied_still_tied"]


def test_rank_state_and_shared_state_round_trip(ranks):
    for r in (0, 1):
        rng_equal, loader = ranks[r]["rank_state"]
        assert rng_equal
        assert loader == {"epoch": 0, "position": 100 * r + 2}  # each rank gets its own back
        assert ranks[r]["shared_state"] == SHARED


def test_only_the_last_keep_last_checkpoints_are_kept(ranks):
    assert ranks[0]["kept"] == ["step_2", "step_3"]


def test_damaged_checkpoints_are_skipped_with_a_warning_and_the_intact_one_loaded(ranks):
    for r in (0, 1):
        assert ranks[r]["resumed_past_damage"] == (10, 10)
        assert ranks[r]["restored_intact"], f"rank {r}: state differs from the intact step 10"
    warnings = "\n".join(ranks[0]["warnings"])
    expected = {"step_15.tmp": "unfinished save", "step_14": "truncated", "step_13": "no COMPLETE",
                "step_12": "missing file rank1.pt", "step_11": "loading checkpoint"}
    for name, reason in expected.items():
        line = next((w for w in ranks[0]["warnings"] if f"/{name}:" in w), None)
        assert line is not None and reason in line, f"no warning for {name} ({reason}) in:\n{warnings}"
    assert not ranks[1]["warnings"], "only rank 0 decides, so only rank 0 warns"


def test_latest_complete_skips_what_the_manifest_shows_is_damaged(ranks):
    # Truncation, missing files and markers are caught from sizes alone; garbled bytes of the right
    # size (step 11) only show when loading, which resume_auto handles.
    assert ranks[0]["latest_complete"] == "step_11"


def test_loading_a_truncated_checkpoint_raises_on_every_rank(ranks):
    for r in (0, 1):
        message = ranks[r]["load_truncated_error"]
        assert "step_14" in message and "truncated" in message


def test_checkpoint_from_another_world_size_is_refused_with_a_fix(ranks):
    single = Checkpointer(ranks["root"] / "run", keep_last=2, rank=0, world=1)
    with pytest.raises(ValueError, match="saved by 2 ranks but this run has 1.*relaunch with 2 ranks"):
        single.load(ranks["root"] / "run" / "step_3", components={"policy": (torch.nn.Linear(2, 2), None)})


def test_unknown_component_is_refused_with_a_fix(ranks):
    ck = Checkpointer(ranks["root"] / "run", keep_last=2, rank=0, world=2)
    with pytest.raises(ValueError, match="no component 'critic'.*'policy'"):
        ck.load(ranks["root"] / "run" / "step_3", components={"critic": (torch.nn.Linear(2, 2), None)})


def test_shard_size_one_trains_like_full_sharding_and_resumes_bitwise(ranks):
    """float32: HSDP's gradient all-reduce and FSDP's reduce-scatter sum the same numbers in the same order at 2 ranks,
    so loss and weights after two AdamW steps agree to float32 rounding."""
    for r in (0, 1):
        assert ranks[r]["hsdp_layout"] == (True, True), "shard size 1: each rank's local tensor is the whole weight"
        for hsdp_loss, full_loss in ranks[r]["hsdp_losses"]:
            assert hsdp_loss == pytest.approx(full_loss, rel=1e-6, abs=1e-7)
        assert ranks[r]["hsdp_max_weight_diff"] <= 1e-6
        assert ranks[r]["hsdp_resumed_step"] == 1 and ranks[r]["hsdp_restored_bitwise"]
        # Each rank read its rows from what it wrote; the other way round would have loaded a part of each weight
        # and left the rest as it was: refused, naming the setting.
        assert ranks[r]["hsdp_into_sharded"]
        assert "IncompatibleCheckpoint" in ranks[r]["sharded_into_hsdp"]
        assert "trainer.shard_size" in ranks[r]["sharded_into_hsdp"]
