"""`optim.name=adamw8bit` (torchao's 8-bit AdamW) on 2 real gloo ranks with FSDP2 shards: the moments are really
8-bit, their bytes are what the planner counts, and they survive a checkpoint round trip and offload bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybrid_rl.checkpoint import Checkpointer
from hybrid_rl.distributed.fsdp import local_tensor
from hybrid_rl.distributed.offload import OffloadManager, optimizer_tensors, plain_tensors
from hybrid_rl.model.optimizers import build_optimizer
from hybrid_rl.planner.param_count import model_params
from hybrid_rl.planner.shards import shard_bytes
from tests.integration.checkpoint.harness import batch, bitwise_equal, spawn


def _sharded(model_dir: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from hybrid_rl.distributed.fsdp import shard_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shard_model(model, init_device_mesh("cpu", (world,)), param_dtype=torch.float32)
    opt = build_optimizer("adamw8bit", model.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # as build.py: lr is a tensor here
    return model, opt, sched


def _step(model, opt, sched, seed: int) -> None:
    ids = batch(seed)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    """This rank's parameter shards and every byte of the optimizer state (8-bit codes, scales, code tables)."""
    snap = {f"param/{n}": local_tensor(p).detach().clone() for n, p in model.named_parameters()}
    snap["lr"] = torch.stack([torch.as_tensor(g["lr"]) for g in opt.param_groups]).clone()
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k, v in state.items():
            for i, t in enumerate(plain_tensors(v)):
                snap[f"optim/{names[id(p)]}/{k}/{i}"] = t.clone()
    return snap


def _scenario(rank: int, world: int, rec: dict, model_dir: str, root: str) -> None:
    from hybrid_rl.model.loading import load_config

    model, opt, sched = _sharded(model_dir, world)
    for seed in (1, 2):
        _step(model, opt, sched, seed)
    moments = [local_tensor(v) for s in opt.state.values() for k, v in s.items() if k.startswith("exp_avg")]
    rec["eight_bit"] = sum(type(m).__name__ == "OptimState8bit" for m in moments)
    rec["fp32"] = sum(m.dtype == torch.float32 and type(m) is torch.Tensor for m in moments)
    rec["moment_bytes"] = sum(t.untyped_storage().nbytes() for t in optimizer_tensors(opt))
    rec["state_bytes"] = rec["moment_bytes"] + 4 * len(opt.state)  # and a float32 step counter per tensor
    rec["planned_bytes"] = shard_bytes(model_params(load_config(model_dir)), world, rank, optimizer="adamw8bit").optim

    ck = Checkpointer(Path(root), keep_last=1, rank=rank, world=world)
    ck.save(2, components={"policy": (model, opt)}, rank_state={}, shared_state={"step": 2})
    saved = _snapshot(model, opt)
    _step(model, opt, sched, 3)
    rec["trained_past_save"] = not bitwise_equal(_snapshot(model, opt), saved)
    fresh_model, fresh_opt, _ = _sharded(model_dir, world)  # a restarted run: an optimizer that never stepped
    ck.resume_auto({"policy": (fresh_model, fresh_opt)})
    rec["resumed_bitwise"] = bitwise_equal(_snapshot(fresh_model, fresh_opt), saved)

    offload = OffloadManager(Path(root) / "offload", rank=rank)
    rec["offload"] = {}
    for target in ("cpu", "disk"):
        before = _snapshot(model, opt)
        freed = offload.offload("actor.optim", optimizer_tensors(opt), target)
        emptied = all(t.untyped_storage().nbytes() == 0 for t in optimizer_tensors(opt))
        offload.reload("actor.optim")
        rec["offload"][target] = (freed, emptied, bitwise_equal(_snapshot(model, opt), before))
    offload.close()


@pytest.fixture(scope="module")
def record(untied_model, tmp_path_factory) -> dict:
    return spawn(_scenario, untied_model, str(tmp_path_factory.mktemp("optim8bit")))


def test_moments_are_8bit_where_torchao_quantises(record):
    for r in record.values():
        assert r["eight_bit"] > 0 and r["fp32"] > 0, r  # large shards 8-bit, small ones (norms, biases) float32


def test_planner_counts_the_8bit_state_exactly(record):
    for r in record.values():
        assert r["state_bytes"] == r["planned_bytes"], r


def test_checkpoint_resumes_the_8bit_state_bitwise(record):
    for r in record.values():
        assert r["trained_past_save"] and r["resumed_bitwise"], r


def test_offload_moves_every_byte_and_restores_bitwise(record):
    for r in record.values():
        for target, (freed, emptied, same) in r["offload"].items():
            assert freed == r["moment_bytes"] and emptied and same, (target, r)
