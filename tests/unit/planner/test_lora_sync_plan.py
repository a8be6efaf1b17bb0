"""The planner counts merged LoRA sync's float32 merge and proposes adapter sync where dropping it makes a run fit."""

from hybrid_rl.config import load_config
from hybrid_rl.plan_inputs import plan_for
from hybrid_rl.planner.inputs import DeviceSpec
from hybrid_rl.planner.units import GIB


def _plan(path: str, sync: str, gib: float):
    cfg = load_config("grpo", [f"model.path={path}", "data.train_files=[/x.jsonl]", "model.lora.rank=8",
                               f"model.lora.sync={sync}", "model.activation_checkpointing=true",
                               "trainer.micro_batch_tokens=1024", "rollout.kv_cache_gb=0.001"])
    return plan_for(cfg, 1, device=DeviceSpec("cuda", int(gib * GIB)))


def _item(plan, what: str) -> int:
    return sum(i.bytes for i in plan.phase("sync").items if i.what.startswith(what))


def test_adapter_sync_is_proposed_when_the_merge_is_what_overflows(tiny_models):
    merged, adapter = _plan(tiny_models["mid"], "merged", 64), _plan(tiny_models["mid"], "adapter", 64)
    # Merged: three float32 copies of the largest adapted weight (world 1: all its rows); adapter: none, but the
    # adapter's LoRA slot in vLLM.
    assert _item(merged, "LoRA merge") > 0 and _item(adapter, "LoRA merge") == 0
    assert _item(adapter, "LoRA adapter") > 0 and _item(merged, "LoRA adapter") == 0
    # The smallest device the adapter plan fits on (bisection: fitting is monotonic in the device size); there the
    # merged plan does not fit, and the planner's fitting fix is adapter sync, saving exactly the difference.
    lo, hi = 0.1, 64.0
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _plan(tiny_models["mid"], "adapter", mid).fits else (mid, hi)
    plan = _plan(tiny_models["mid"], "merged", hi)
    assert not plan.fits and plan.peak.name == "sync", plan.peak
    fitting = [f for f in plan.fixes if f.fits]
    assert [f.setting for f in fitting] == ["model.lora.sync=adapter"], plan.fixes
    assert fitting[0].saves == plan.peak.total - _plan(tiny_models["mid"], "adapter", hi).phase("sync").total
