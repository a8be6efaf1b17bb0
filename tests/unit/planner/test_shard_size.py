"""`trainer.shard_size`: the plan counts each rank's share of the models for the chosen layout, auto picks the
smallest shard size that fits (the most replicas), and the verdict names the layout."""

import pytest

from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.plan_inputs import plan_for
from hybrid_rl.planner.inputs import DeviceSpec
from hybrid_rl.planner.table import verdict

GIB = 2**30


def _cfg(tiny_models, *overrides):
    return load_config("grpo", [f"model.path={tiny_models['qwen2']}", "data.train_files=[/x.jsonl]", *overrides])


def _actor_params(plan) -> int:
    return next(i.bytes for i in plan.phase("update").items if i.component == "actor" and i.what.startswith("params"))


def test_auto_replicates_a_model_that_fits_every_rank_and_the_verdict_says_so(tiny_models):
    plan = plan_for(_cfg(tiny_models), 4, device=DeviceSpec("cuda", 64 * GIB))
    assert plan.fits and plan.inputs.shard_ranks == 1
    assert "trainer.shard_size=1" in verdict(plan) and "4 replicas" in verdict(plan)
    assert any("auto) chose 1" in n for n in plan.notes)
    full = plan_for(_cfg(tiny_models, "trainer.shard_size=4"), 4, device=DeviceSpec("cuda", 64 * GIB))
    assert full.inputs.shard_ranks == 4 and "sharded over all 4 ranks" in verdict(full)
    # A whole copy per rank: about 4x a quarter shard (dim 0 padding makes the shard a little larger).
    assert 3.5 * _actor_params(full) < _actor_params(plan) <= 4 * _actor_params(full)


def _peaks(tiny_models) -> dict[int, int]:
    # A CPU device: vLLM's share does not scale with the device's size and there is no safety margin.
    return {s: plan_for(_cfg(tiny_models, f"trainer.shard_size={s}"), 4,
                        device=DeviceSpec("cpu", 64 * GIB)).peak.total for s in (1, 2, 4)}


def test_auto_picks_the_largest_replication_that_fits(tiny_models):
    """On a device between the plans of shard sizes 1 and 2 (world 4), auto takes 2; below 4's it shards fully."""
    peak = _peaks(tiny_models)
    assert peak[1] > peak[2] > peak[4]
    chosen = plan_for(_cfg(tiny_models), 4, device=DeviceSpec("cpu", (peak[1] + peak[2]) // 2))
    assert chosen.inputs.shard_ranks == 2 and chosen.fits and "2 replicas each sharded over 2 ranks" in verdict(chosen)
    tight = plan_for(_cfg(tiny_models), 4, device=DeviceSpec("cpu", peak[4] - 1))
    assert tight.inputs.shard_ranks == 4 and not tight.fits


def test_sharding_wider_is_among_the_fixes_of_a_replicated_layout(tiny_models):
    from hybrid_rl.planner.advice import _candidates

    x = plan_for(_cfg(tiny_models, "trainer.shard_size=1"), 4, device=DeviceSpec("cpu", GIB)).inputs
    wider = {setting: after for setting, _, after in _candidates(x)}
    assert wider["trainer.shard_size=4"].shard_ranks == 4 and "shard over 8 ranks instead of 4" not in wider


def test_a_shard_size_must_divide_the_world(tiny_models):
    with pytest.raises(ConfigError, match="trainer.shard_size=3 must divide"):
        plan_for(_cfg(tiny_models, "trainer.shard_size=3"), 4, device=DeviceSpec("cuda", 64 * GIB))


def test_shared_memory_collectives_are_counted_where_they_run(tiny_models):
    """CPU ranks sharding a model map the blocks' all-gather ring and gradient segments (`distributed/shm_comms`):
    counted in every phase after start-up, as the resident memory measures them; not with one rank, shard size 1,
    the switch off, or on a GPU."""
    from hybrid_rl.distributed.shm_comms import AG_SLOTS

    def item(*overrides, world=2, kind="cpu"):
        plan = plan_for(_cfg(tiny_models, *overrides), world, device=DeviceSpec(kind, 64 * GIB))
        got = {p.name: sum(i.bytes for i in p.items if "shared memory" in i.what) for p in plan.phases}
        return got, plan.inputs

    got, x = item("trainer.shard_size=2")
    block = x.actor.block_numel()
    assert got["startup"] == 0
    assert got["update"] == got["rollout"] == AG_SLOTS * block * x.compute_bytes + block * 4 + block * 4 // 2 > 0
    for overrides, world, kind in (((), 1, "cpu"), (("trainer.shard_size=1",), 2, "cpu"),
                                   (("trainer.shard_size=2", "trainer.cpu_shm_collectives=false"), 2, "cpu"),
                                   (("trainer.shard_size=2",), 2, "cuda")):
        assert not any(item(*overrides, world=world, kind=kind)[0].values()), (overrides, world, kind)
