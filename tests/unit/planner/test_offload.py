"""Where the planner puts offloaded items matches what the trainer does with `offload.*` (distributed/offload.py)."""

import pytest

from hybrid_rl.config import load_config
from hybrid_rl.plan_inputs import plan_for
from hybrid_rl.planner.inputs import DeviceSpec


def _off(plan, phase: str, component: str) -> dict[str, str]:
    """What of `component` is off the device in `phase`: item -> target."""
    return {i.what.split(" (")[0]: i.offloaded for i in plan.phase(phase).items if i.component == component}


@pytest.mark.parametrize("device, target", [("cuda", "cpu"), ("cpu", "disk")])
def test_the_critic_leaves_with_its_optimizer_state_and_comes_back_for_its_pass_and_update(tiny_models, device,
                                                                                            target):
    cfg = load_config("ppo", [f"model.path={tiny_models['qwen2']}", "data.train_files=[/x.jsonl]",
                              f"offload.critic={target}", f"offload.reference={target}"])
    plan = plan_for(cfg, 2, device=DeviceSpec(device, 64 * 2**30))
    for phase in ("sync", "rollout", "old_logp", "reference", "update"):
        assert _off(plan, phase, "critic") == {"params": target, "AdamW states": target}, phase
    assert _off(plan, "critic", "critic")["params"] == "" and _off(plan, "critic", "critic")["AdamW states"] == target
    assert set(_off(plan, "critic_update", "critic").values()) == {""}  # everything in for the update
    assert _off(plan, "update", "reference") == {"params": target}


def test_cpu_offload_frees_nothing_on_a_cpu_device(tiny_models):
    cfg = load_config("ppo", [f"model.path={tiny_models['qwen2']}", "data.train_files=[/x.jsonl]",
                              "offload.critic=cpu"])
    plan = plan_for(cfg, 2, device=DeviceSpec("cpu", 64 * 2**30))
    assert set(_off(plan, "update", "critic").values()) == {""}
    assert any("offload.critic=cpu frees nothing" in n for n in plan.notes)


def test_the_distillation_teacher_is_counted_with_its_own_pass_and_offload(tiny_models):
    cfg = load_config("opd", [f"model.path={tiny_models['qwen2']}", "data.train_files=[/x.jsonl]",
                              f"teacher.path={tiny_models['mid']}", "offload.teacher=cpu"])
    plan = plan_for(cfg, 2, device=DeviceSpec("cuda", 64 * 2**30))
    assert "teacher" in [p.name for p in plan.phases]
    teacher = [i for i in plan.phase("teacher").items if i.component == "teacher"]
    kinds = {i.what.split(" (")[0].split(",")[0] for i in teacher}
    assert kinds == {"params", "compute copies", "activations"}, kinds
    assert all(i.offloaded == "" for i in teacher)  # in for its pass
    for phase in ("rollout", "old_logp", "update"):
        assert _off(plan, phase, "teacher") == {"params": "cpu"}, phase
    # The teacher (12 layers, 256 wide) is several times the student's size, and its shards are counted.
    student = next(i for i in plan.phase("teacher").items if i.component == "actor" and i.what.startswith("params"))
    assert next(i for i in teacher if i.what.startswith("params")).bytes > 3 * student.bytes
