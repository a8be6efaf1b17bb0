"""LoRA under FSDP2 (one spawned gloo process): a reference pass first does not break FSDP2's mixed-precision
gradients."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.model.lora import adapter_disabled, apply_lora


def _first_forward_is_the_reference(rank: int, port: int, path: str, results) -> None:
    """The GRPO order on a bf16-compute FSDP2 LoRA actor: reference pass first, then a training step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid_rl.distributed.fsdp import shard_model

    ids = torch.randint(5, 400, (1, 12))
    for name, reference in (("peft", lambda m: m.disable_adapter()), ("ours", adapter_disabled)):
        torch.manual_seed(0)
        model = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), rank=4, alpha=8.0,
                           dropout=0.0, target_modules=["q_proj", "v_proj"])
        shard_model(model, init_device_mesh("cpu", (1,)), param_dtype=torch.bfloat16)  # as build.py's defaults
        with torch.no_grad(), reference(model):
            model(input_ids=ids)
        try:
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
            results[name] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
        except RuntimeError as e:
            results[name] = str(e)
    dist.destroy_process_group()


def test_a_reference_pass_before_the_first_update_keeps_float32_gradients(tiny_models):
    results = mp.Manager().dict()
    mp.spawn(_first_forward_is_the_reference, args=(free_port(), tiny_models["qwen2"], results), nprocs=1)
    # With peft's context the bug this guards against is there: FSDP2 saw no trainable parameter ...
    assert "attempting to assign a gradient with dtype 'c10::BFloat16'" in str(results["peft"])
    assert results["ours"] == ["torch.float32"]  # ... with ours the adapter's grads are cast to the master dtype
