"""FSDP2 (`fully_shard`) of a Hugging Face decoder: one unit per transformer block, then the root.

Mixed precision casts parameters to `param_dtype` for compute and reduces gradients in
`reduce_dtype`; the sharded master weights stay in float32. On CPU, `cpu_offload` uses
`CPUOffloadPolicy(pin_memory=False)` (pinned memory needs an accelerator).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of an HF causal LM (or of its LoRA/value-head wrapper)."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return list(layers)
    raise ValueError(f"{type(model).__name__}: found no `layers` ModuleList to shard per block")


def shard_model(
    model: nn.Module, mesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False, reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply `fully_shard` per block and to the root, in place; returns the model."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


# Added to parameter names by activation checkpointing, torch.compile and FSDP1; Hugging Face names have none.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name, with wrapper prefixes removed."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (a DTensor's local tensor; a plain tensor is its own shard)."""
    return p.to_local() if hasattr(p, "to_local") else p


def is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local")
