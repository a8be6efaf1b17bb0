"""The recipes' training side on one GPU: `build` and `Trainer` as `hybrid_rl.train` runs them, at the recipes'
own batch shapes (32 prompts x n samples) on Qwen2.5-shaped models, with 128 new tokens a sample instead of 512.

The shorter responses are for the stand-in generator's sake: its eager decode, one FSDP forward per token, took
51 s of a 74 s step at 512 tokens on an H200 (1.5B, 128 samples), and the first GPU run of this suite ran out of its
time. The update's micro-batches stay full (`trainer.micro_batch_tokens`, 8192 tokens: several per step here), so
the phases the plan is checked against keep their size.

What runs on CUDA here and nowhere else in the tests: the world `cpu:gloo,cuda:nccl` bound to the GPU, shards
allocated on the GPU and filled from the checkpoint, FSDP2's bf16 passes through the packed attention and the
chunked log-probs, AdamW's state on the GPU, `offload.*=cpu` through pinned (`cudaHostRegister`-ed) buffers, the
distributed checkpoint written from and read back onto the GPU, and each phase's peak allocation beside the
memory plan's prediction. The generator is `eager_rollout.EagerEngine` (vLLM is not installed on the GPU machine).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybrid_rl.demo.arithmetic import write_arithmetic
from tests.conftest import run_torchrun
from tests.gpu.conftest import report

WORKER = Path(__file__).parent / "train_worker.py"
GIB = 2**30
# Items of the plan that torch.cuda.max_memory_allocated() does not see: vLLM (not running here), the CUDA context
# and NCCL's buffers (outside PyTorch's allocator).
NOT_ALLOCATED = {"vllm", "process"}
# vLLM's phases: the eager generator is not vLLM (its KV cache is not the plan's, and it has no weight sync).
VLLM_PHASES = {"sync", "rollout"}
SHORTER = "rollout.max_new_tokens=128"
# case -> (recipe, Qwen2.5 shape, overrides, resume): a resumed step (one more launch, a minute or two) only where
# it reads back the most kinds of state, so that the whole suite fits one 10-minute call on a lent GPU.
CASES = {
    # the grpo recipe as shipped (full fine-tuning, no checkpointing), its reference offloaded between its passes
    "grpo_0.5B": ("grpo", "0.5B", [SHORTER, "offload.reference=cpu"], False),
    # the ppo recipe as the README's GPU command runs it (activation checkpointing), with a critic whose weights and
    # optimizer state go to host memory between its passes and updates
    "ppo_1.5B": ("ppo", "1.5B", [SHORTER, "model.activation_checkpointing=true", "offload.critic=cpu",
                                 "offload.reference=cpu"], True),
    # LoRA on the grpo recipe: a bf16 frozen base under FSDP2 with float32 adapters; the reference is the base itself
    "grpo_lora_0.5B": ("grpo", "0.5B", [SHORTER, "model.lora.rank=16"], False),
}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("case", list(CASES))
def test_recipe_trains_and_stays_within_its_memory_plan(case, qwen_shape, tmp_path):
    recipe, size, extra, resume = CASES[case]
    train, _ = write_arithmetic(tmp_path / "data", n_train=512, n_val=0)
    out = tmp_path / "run"
    args = [f"--config-name={recipe}", f"model.path={qwen_shape(size)}", f"data.train_files=[{train}]",
            f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.save_every=0", "trainer.export=false",
            "trainer.show_progress=false", *extra]
    result = run_torchrun(WORKER, *args, nproc=1, timeout=900, tmp_path=tmp_path)
    steps = [r for r in _records(out / "metrics.jsonl") if "actor/grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2], steps

    # The update ran on real numbers (a gradient wherever there was an advantage: random weights earn GRPO no reward
    # at all, so its advantages, and its gradient at step 1, are zero), and the generator's log-probs are the
    # trainer's (bf16 both sides).
    for r in steps:
        assert math.isfinite(r["actor/grad_norm"]), r
        assert r["actor/grad_norm"] > 0 or (r["reward/std"] == 0 and recipe == "grpo"), r
        assert r["rollout/logprob_diff_mean"] < 0.05, r

    # Every training phase's peak allocation is covered by the plan's items that PyTorch allocates.
    phases = {name: items for name, items in result["phases"].items()}
    comparison = {}
    for phase, items in phases.items():
        measured = max((r.get(f"memory/{phase}/peak_gib", -1.0) for r in steps), default=-1.0)
        if phase in VLLM_PHASES or measured < 0:
            continue
        planned = sum(b for comp, _, b, off in items if comp not in NOT_ALLOCATED and not off) / GIB
        comparison[phase] = {"measured_gib": round(measured, 3), "planned_allocated_gib": round(planned, 3),
                             "planned_over_measured": round(planned / measured, 3)}
    report(case, {"device": result["device"], "device_gib": result["device_total_bytes"] / GIB,
                  "plan_fits": result["fits"], "phases": comparison,
                  "steps": [{k: v for k, v in r.items() if k.startswith(("timing/", "memory/", "rollout/logprob",
                                                                        "actor/grad_norm", "response/length_mean"))}
                            for r in steps],
                  "plan_items": phases})

    assert "update" in comparison, comparison
    for phase, c in comparison.items():
        assert c["measured_gib"] <= c["planned_allocated_gib"], (phase, c)

    if resume:  # one more step from the checkpoint written at step 2 (its shards read back onto the GPU)
        args = [a.replace("trainer.total_steps=2", "trainer.total_steps=3") for a in args]
        run_torchrun(WORKER, *args, nproc=1, timeout=900, tmp_path=tmp_path)
        resumed = [r for r in _records(out / "metrics.jsonl") if "actor/grad_norm" in r]
        assert [r["step"] for r in resumed] == [1, 2, 3], resumed
        assert math.isfinite(resumed[-1]["actor/grad_norm"])
