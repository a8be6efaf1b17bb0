"""FSDP2 (`fully_shard`) of a Hugging Face decoder: one unit per transformer block, then the root.

Mixed precision casts parameters to `param_dtype` for compute and reduces gradients in
`reduce_dtype`; the sharded master weights stay in float32. On CPU, `cpu_offload` uses
`CPUOffloadPolicy(pin_memory=False)` (pinned memory needs an accelerator), and every unit gathers and
reduces through `gloo_comms`' pairwise exchanges instead of gloo's own collectives (2-3x faster there).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from hybrid_rl.distributed import gloo_comms, shm_comms


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of an HF causal LM (or of its LoRA/value-head wrapper)."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return list(layers)
    raise ValueError(f"{type(model).__name__}: found no `layers` ModuleList to shard per block")


def shard_model(
    model: nn.Module, mesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False, reshard_after_forward: bool | None = None, shared_memory: bool = True,
) -> nn.Module:
    """Apply `fully_shard` per block and to the root, in place; returns the model.

    `reshard_after_forward` None: True, except where each rank holds every weight whole (a shard size of 1: one
    rank, or HSDP with `trainer.shard_size=1`). There resharding frees no memory that matters (the float32 weights
    stay) and backward would copy every block's compute copy again; so a forward that records a graph keeps its
    compute copies for backward (which frees them), and a no-grad pass frees them when it ends (`_reshard_if_no_grad`).

    `shared_memory` (CPU, `trainer.cpu_shm_collectives`): the ranks of one host gather and reduce through shared
    memory (`shm_comms`); otherwise, and across hosts, by gloo's pairwise exchanges (`gloo_comms`).
    """
    whole = _mesh_shard_size(mesh) == 1
    if reshard_after_forward is None:
        reshard_after_forward = not whole
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    units = [*transformer_blocks(model), model]
    for unit in units:
        fully_shard(unit, **kwargs)
    if mesh.device_type == "cpu" and mesh.size() > 1:
        if shared_memory and not whole:
            shm_comms.install(units, units[:-1], mesh.get_group(mesh.ndim - 1))
        else:
            for unit in units:
                gloo_comms.install(unit, one_rank=whole)
    if not reshard_after_forward:
        model.register_forward_hook(_reshard_if_no_grad(units))
    return model


def _mesh_shard_size(mesh) -> int:
    """Ranks a weight is split over on `mesh`: its last dimension (FSDP2 shards over it; HSDP replicates over the first)."""
    return mesh.size(mesh.ndim - 1)


def _reshard_if_no_grad(units: list[nn.Module]):
    """A forward hook: after a pass without autograd (no backward will free the compute copies), free them now."""

    def hook(module, args, output):
        if not torch.is_grad_enabled():
            for unit in units:
                unit.reshard()
        return output

    return hook


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


def _shard_dim(p: torch.Tensor) -> int:
    """The mesh dimension FSDP2 shards `p`'s rows over: its only Shard(0) placement (any other is Replicate)."""
    from torch.distributed.tensor import Replicate, Shard

    dims = [d for d, pl in enumerate(p.placements) if pl == Shard(0)]
    if len(dims) != 1 or any(pl != Replicate() for d, pl in enumerate(p.placements) if d != dims[0]):
        raise ValueError(f"expected FSDP2's Shard(0) (replicated over HSDP's other mesh dim), got {p.placements}")
    return dims[0]


def shard_size(module: nn.Module) -> int:
    """Ranks each weight of `module` is split over: the mesh's shard dimension (1 for a plain module, and for HSDP
    with shard size 1, where every rank holds every weight whole)."""
    for p in module.parameters():
        if is_sharded(p):
            return p.device_mesh.size(_shard_dim(p))
    return 1


def local_rows(p: torch.Tensor) -> tuple[int, int]:
    """Rows [a, b) of dim 0 that this rank's shard of `p` holds; a plain tensor holds them all.

    FSDP2 shards dim 0 over the mesh's shard dimension with torch.chunk semantics: chunks of ceil(rows / shard),
    the last ones short or empty (as `weightsync/plan.fsdp_row_ranges`).
    """
    if not is_sharded(p):
        return 0, p.shape[0]
    d = _shard_dim(p)
    rows, world, rank = p.shape[0], p.device_mesh.size(d), p.device_mesh.get_local_rank(d)
    chunk = -(-rows // world)
    a, b = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    if p.to_local().shape[0] != b - a:
        raise AssertionError(f"local shard has {p.to_local().shape[0]} rows, expected {b - a} (rows {a}:{b})")
    return a, b
