"""The planner's start-up phase and the frozen models' stored dtype (`model.frozen_dtype`)."""

import pytest

from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.model.materialize import READ_CHUNK_BYTES
from hybrid_rl.plan_inputs import plan_for
from hybrid_rl.planner.inputs import DeviceSpec, PlanInputs
from hybrid_rl.planner.shards import shard_bytes

DEVICE = DeviceSpec("cuda", 80 * 2**30)


def _plan(path: str, *overrides: str, world: int = 4):
    cfg = load_config("ppo", [f"model.path={path}", "data.train_files=[/x.jsonl]", *overrides])
    return plan_for(cfg, world, device=DEVICE, attention="sdpa")


def _items(phase) -> dict[str, int]:
    return {f"{i.component} {i.what}": i.bytes for i in phase.items}


def test_startup_holds_each_models_shards_and_one_read(tiny_models):
    plan = _plan(tiny_models["mid"], "reward.model_path=" + tiny_models["mid"], "trainer.shard_size=4")
    assert plan.phases[0].name == "startup"
    x, items = plan.inputs, _items(plan.phase("startup"))
    assert items.pop("actor params (fp32 shard)") == shard_bytes(x.actor.params, 4).params
    assert items.pop("critic params (fp32 shard)") == shard_bytes(x.critic.params, 4).params
    # model.dtype is bf16 (the default) and frozen_dtype auto: the frozen models are stored in 16 bits.
    assert items.pop("reference params (16-bit shard)") == shard_bytes(x.reference.params, 4).params // 2
    assert items.pop("reward_model params (16-bit shard)") == shard_bytes(x.reward_model.params, 4).params // 2
    read = items.pop("loading checkpoint read (rows + mapped pages)")
    assert 0 < read <= 2 * READ_CHUNK_BYTES
    process = [items.pop(k) > 0 for k in list(items) if k.startswith("process")]  # the process (CUDA: + NCCL)
    assert process and all(process)
    assert items == {}  # no optimizer state, no vLLM yet


def test_frozen_dtype_sets_the_reference_in_every_phase(tiny_models):
    auto = _plan(tiny_models["mid"], "model.dtype=float32")
    half = _plan(tiny_models["mid"], "model.dtype=float32", "model.frozen_dtype=bfloat16")
    for phase in ("startup", "reference", "update"):
        assert _items(auto.phase(phase))["reference params (fp32 shard)"] == \
            2 * _items(half.phase(phase))["reference params (16-bit shard)"]


def test_planner_reads_with_the_loaders_chunk():
    assert PlanInputs.__dataclass_fields__["load_chunk_bytes"].default == READ_CHUNK_BYTES


def test_frozen_dtype_is_validated(tiny_models):
    with pytest.raises(ConfigError, match="model.frozen_dtype='int8' is not allowed; choose one of: auto"):
        load_config("ppo", [f"model.path={tiny_models['qwen2']}", "data.train_files=[/x.jsonl]",
                            "model.frozen_dtype=int8"])
