"""`MemoryPlan.keeps_freed_host_memory`: on CPU, glibc may keep freed buffers for reuse when twice the plan's peak
fits the rank's memory; never on a GPU (its host memory is not what the plan counts), and the table says which."""

from hybrid_rl.config import load_config
from hybrid_rl.plan_inputs import plan_for
from hybrid_rl.planner.inputs import DeviceSpec
from hybrid_rl.planner.table import render

GIB = 2**30


def _plan(tiny_models, device: DeviceSpec):
    cfg = load_config("grpo", [f"model.path={tiny_models['qwen2']}", "data.train_files=[/x.jsonl]"])
    return plan_for(cfg, 2, device=device)


def test_freed_buffers_are_kept_only_where_twice_the_peak_fits(tiny_models):
    peak = _plan(tiny_models, DeviceSpec("cpu", 64 * GIB)).peak.total
    roomy = _plan(tiny_models, DeviceSpec("cpu", 2 * peak))
    assert roomy.keeps_freed_host_memory and "stay mapped for reuse" in render(roomy)
    tight = _plan(tiny_models, DeviceSpec("cpu", 2 * peak - 1))
    assert tight.fits and not tight.keeps_freed_host_memory
    assert "return every freed buffer of 1 MiB or more at once" in render(tight)
    assert not _plan(tiny_models, DeviceSpec("cuda", 64 * GIB)).keeps_freed_host_memory
