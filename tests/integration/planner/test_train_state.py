"""Params, grads and AdamW state: predicted bytes equal measured bytes exactly, plain and FSDP2-sharded.

FSDP2 pads dim 0 of every parameter to a multiple of the world size: params and grads hold the
padded shard; AdamW's moments are `zeros_like` of the unpadded local shard. World 3 makes the
padding visible (hidden 128, 64-wide k/v and 32-wide q/k norms do not divide by 3).
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.planner.param_count import lora_params, model_params
from hybrid_rl.planner.shards import shard_bytes

from .conftest import ARCHS

WORLD = 3


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (FSDP grads are views of one flat buffer)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _measure(model: torch.nn.Module) -> tuple[int, int, int]:
    """(param, grad, AdamW state) bytes this process holds after one backward and one optimizer step."""
    from hybrid_rl.distributed.offload import grad_tensors, param_tensors

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.arange(24)[None] % 97
    model(input_ids=ids, position_ids=torch.arange(24)[None], use_cache=False).logits.float().logsumexp(-1).sum() \
        .backward()
    grads = _storage_bytes(grad_tensors(model))
    opt.step()
    state = [v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for v in s.values()]
    return _storage_bytes(param_tensors(model)), grads, _storage_bytes(state)


def _predicted(path: str, world: int, rank: int, lora: bool = False) -> tuple[int, int, int]:
    from hybrid_rl.model.loading import load_config

    params = model_params(load_config(path))
    if lora:
        params = lora_params(params, rank=4, target_modules=["q_proj", "v_proj", "down_proj"])
    s = shard_bytes(params, world, rank)
    return s.params, s.grads, s.optim


def _lora(model):
    from hybrid_rl.model.lora import apply_lora

    return apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


def test_plain_model_bytes_are_exact(arch_paths):
    from hybrid_rl.model.loading import load_causal_lm

    for name in ARCHS:
        assert _measure(load_causal_lm(arch_paths[name])) == _predicted(arch_paths[name], 1, 0), name
    lora = _lora(load_causal_lm(arch_paths["qwen2"]))
    assert _measure(lora) == _predicted(arch_paths["qwen2"], 1, 0, lora=True)


def _worker(rank: int, world: int, port: int, paths: dict[str, str], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid_rl.distributed.fsdp import shard_model
    from hybrid_rl.model.loading import load_causal_lm

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, path in paths.items():
        for lora in (False, True) if name == "qwen2" else (False,):
            model = load_causal_lm(path)
            model = _lora(model) if lora else model
            shard_model(model, mesh, param_dtype=torch.bfloat16)  # as build.py: bf16 compute, fp32 shards
            out[(name, lora)] = (_measure(model), _predicted(path, world, rank, lora))
    results[rank] = out
    dist.destroy_process_group()


def test_fsdp2_padded_shards_are_exact_on_every_rank(arch_paths):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(WORLD, free_port(), dict(arch_paths), results), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        for key, (measured, predicted) in results[rank].items():
            assert measured == predicted, (rank, key)
    # The padding is real: rank 2 holds fewer optimizer rows than rank 0, the same padded params.
    p0, p2 = results[0][("qwen2", False)][0], results[2][("qwen2", False)][0]
    assert p0[0] == p2[0] and p0[2] > p2[2]
