"""vLLM's share of a GPU when `rollout.gpu_memory_utilization` is auto: the planner applies the rule the
engine applies at start-up (memory free then, less the sync's reserve, at most 0.9) to the memory the
trainer is predicted to hold at the first sync."""

import pytest

from hybrid_rl.config import load_config
from hybrid_rl.plan_inputs import plan_for
from hybrid_rl.planner.inputs import DeviceSpec
from hybrid_rl.planner.trainer_memory import cuda_resident_overhead_bytes, trainer_items
from hybrid_rl.planner.units import GIB
from hybrid_rl.planner.vllm_memory import (
    auto_gpu_memory_utilization,
    kv_cache_bytes,
    plan_sync_reserve,
    sync_reserve_bytes,
    vllm_kept_asleep_bytes,
    vllm_utilization,
    vllm_weight_bytes,
)


def _cfg(path: str, *overrides: str):
    return load_config("ppo", [f"model.path={path}", "data.train_files=[/nowhere.jsonl]", *overrides])


def test_the_rule():
    assert auto_gpu_memory_utilization(70 * GIB, 80 * GIB, 2 * GIB) == 0.85  # (70 - 2) / 80
    assert auto_gpu_memory_utilization(79 * GIB, 80 * GIB, 1 * GIB) == 0.9  # capped
    assert auto_gpu_memory_utilization(int(40.5 * GIB), 80 * GIB, 0) == 0.5  # rounded down: never above free
    assert auto_gpu_memory_utilization(GIB, 80 * GIB, 2 * GIB) < 0  # nothing left: the engine refuses to start
    assert sync_reserve_bytes(256 * 2**20) == 3 * 256 * 2**20 + GIB


def test_planner_gives_vllm_what_the_trainer_leaves_at_the_first_sync(tiny_models):
    device = DeviceSpec("cuda", 4 * GIB)
    plan = plan_for(_cfg(tiny_models["mid"], "rollout.bucket_mb=16"), 2, device=device)
    x = plan.inputs
    assert x.rollout.gpu_memory_utilization is None and x.rollout.release == "sleep"
    held = sum(i.on_device for i in trainer_items(x, "sync", first_step=True))
    assert held > 0  # actor shards + AdamW + the reference and critic, resident until their first pass
    held += cuda_resident_overhead_bytes(x)  # and the CUDA context and NCCL, which vLLM's start-up check sees as used
    share = vllm_utilization(x)
    # The sync's reserve (three 16 MiB buckets: the mid model's largest module is smaller) and the 5% margin.
    assert plan_sync_reserve(x) == 3 * 16 * 2**20 + GIB + int(0.05 * 4 * GIB)
    assert share == auto_gpu_memory_utilization(4 * GIB - held, 4 * GIB, plan_sync_reserve(x)) > 0
    assert kv_cache_bytes(x) == int(share * 4 * GIB) - vllm_weight_bytes(x.actor, 1, 2) - vllm_kept_asleep_bytes(x)
    assert any("gpu_memory_utilization=auto" in n for n in plan.notes)
    # Offloading the optimizer state before the sync leaves vLLM more.
    offloaded = plan_for(_cfg(tiny_models["mid"], "rollout.bucket_mb=16", "offload.actor_optim=cpu"), 2, device=device)
    assert vllm_utilization(offloaded.inputs) > share


@pytest.mark.parametrize("override,share", [("rollout.gpu_memory_utilization=0.3", 0.3),
                                            ("rollout.kv_cache_gb=0.25", None)])
def test_explicit_settings_are_planned_as_given(tiny_models, override, share):
    x = plan_for(_cfg(tiny_models["mid"], override), 2, device=DeviceSpec("cuda", 2 * GIB)).inputs
    assert x.rollout.gpu_memory_utilization == share
    if share is None:
        assert kv_cache_bytes(x) == int(0.25 * GIB)
