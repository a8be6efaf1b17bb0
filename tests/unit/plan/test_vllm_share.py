"""vLLM's share of a GPU when `rollout.gpu_memory_utilization` is auto: the planner applies the rule the
engine applies at start-up (memory free then, less the sync's reserve, at most 0.9) to the memory the
trainer is predicted to hold at the first sync."""

import pytest

from hybrid_rl.config import load_config
from hybrid_rl.model.memory_plan import (
    CUDA_CONTEXT_BYTES,
    GIB,
    DeviceSpec,
    _trainer_items,
    auto_gpu_memory_utilization,
    kv_cache_bytes,
    sync_reserve_bytes,
    vllm_utilization,
    vllm_weight_bytes,
)
from hybrid_rl.planner import plan_for


def _cfg(path: str, *overrides: str):
    return load_config("ppo", [f"model.path={path}", "data.train_files=[/nowhere.jsonl]", *overrides])


def test_the_rule():
    assert auto_gpu_memory_utilization(70 * GIB, 80 * GIB, 2 * GIB) == 0.85  # (70 - 2) / 80
    assert auto_gpu_memory_utilization(79 * GIB, 80 * GIB, 1 * GIB) == 0.9  # capped
    assert auto_gpu_memory_utilization(int(40.5 * GIB), 80 * GIB, 0) == 0.5  # rounded down: never above free
    assert auto_gpu_memory_utilization(GIB, 80 * GIB, 2 * GIB) < 0  # nothing left: the engine refuses to start
    assert sync_reserve_bytes(256 * 2**20) == 3 * 256 * 2**20 + GIB


def test_planner_gives_vllm_what_the_trainer_leaves_at_the_first_sync(tiny_models):
    device = DeviceSpec("cuda", 2 * GIB)
    plan = plan_for(_cfg(tiny_models["mid"], "rollout.bucket_mb=16"), 2, device=device)
    x = plan.inputs
    assert x.rollout.gpu_memory_utilization is None and x.rollout.release == "sleep"
    held = sum(i.on_device for i in _trainer_items(x, "sync", first_step=True))
    assert held > 0  # actor shards + AdamW + the reference and critic, resident until their first pass
    held += CUDA_CONTEXT_BYTES  # and the CUDA context, which vLLM's start-up check also sees as used
    share = vllm_utilization(x)
    assert share == auto_gpu_memory_utilization(2 * GIB - held, 2 * GIB, 3 * 16 * 2**20 + GIB) > 0
    assert kv_cache_bytes(x) == int(share * 2 * GIB) - vllm_weight_bytes(x.actor, 1, 2)
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
