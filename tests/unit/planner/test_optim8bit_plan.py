"""The planner proposes 8-bit optimizer states when they make the update phase fit, and counts them in the plan."""

from hybrid_rl.config import load_config
from hybrid_rl.plan_inputs import plan_for
from hybrid_rl.planner.inputs import DeviceSpec
from hybrid_rl.planner.phases import FRAGMENTATION
from hybrid_rl.planner.units import GIB


def _plan(path: str, optimizer: str, gib: float):
    cfg = load_config("grpo", [f"model.path={path}", "data.train_files=[/x.jsonl]", f"optim.name={optimizer}",
                               "model.activation_checkpointing=true", "trainer.micro_batch_tokens=1024"])
    return plan_for(cfg, 2, device=DeviceSpec("cuda", int(gib * GIB)))


def test_adamw8bit_is_the_fix_when_the_optimizer_state_is_what_overflows(tiny_models):
    full, eight = (_plan(tiny_models["mid"], o, 64).phase("update") for o in ("adamw", "adamw8bit"))
    state = {p: next(i.bytes for i in ph.items if i.component == "actor" and i.what.startswith("AdamW"))
             for p, ph in (("adamw", full), ("adamw8bit", eight))}
    assert 0.25 <= state["adamw8bit"] / state["adamw"] <= 0.3  # ~1 byte per moment element plus block scales
    # The plan saves the state's bytes and the allocator's fragmentation share of them, nothing else.
    saved = state["adamw"] - state["adamw8bit"]
    assert abs((full.total - eight.total) - saved * (1 + FRAGMENTATION)) <= 16
    # The smallest device the 8-bit plan fits on (bisection: fitting is monotonic in the device size); there the
    # AdamW plan does not fit, and the planner's only fitting fix is the 8-bit states.
    lo, hi = 0.5, 64.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _plan(tiny_models["mid"], "adamw8bit", mid).fits else (mid, hi)
    device_gib = hi
    plan = _plan(tiny_models["mid"], "adamw", device_gib)
    assert not plan.fits
    fitting = [f for f in plan.fixes if f.fits]
    assert [f.setting for f in fitting] == ["optim.name=adamw8bit"], plan.fixes
    assert fitting[0].saves == plan.peak.total - _plan(tiny_models["mid"], "adamw8bit", device_gib).phase(plan.peak.name).total
