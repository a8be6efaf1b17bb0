"""The colocated weight sync's CUDA path at world 1, through the real `HybridEngine` switch.

On one GPU the engine asks for the in-place path with `row_landing`: the resharder hands over the trainer's
float32 FSDP2 shards themselves (no bucket buffer, no all-to-all), `load_inplace` casts them to bf16 as it copies
them into vLLM's parameters, and the verification reads them back and checksums them on the GPU. vLLM cannot be
installed on the GPU machine (its CUDA wheel is too large to carry there), so its side is a stand-in holding what
vLLM 0.32 holds on CUDA for Qwen2 and is synced through: dense bf16 parameters under vLLM's fused names
(`qkv_proj`, `gate_up_proj`), the head tied to the embedding module, landed by `vllm_weights.load_inplace` and read
by `vllm_weights.readback`, as `vllm_transfer.InProcessTransfer` and `VLLMEngine.readback` call them. The same
landing into vLLM's own parameter classes is tested on CPU (`tests/unit/weightsync/test_inplace_vllm_layers.py`).

What runs on CUDA here and nowhere else: the sync's slices as views of CUDA DTensor shards, the cast-as-copied
landing on the device, `block_checksum` with its weight vectors cached on the device, the engine's collective
verdict over `cpu:gloo,cuda:nccl`, and the optimizer state offloaded to pinned host memory and back around each
switch. Figures: the sync's time against a device copy of its bytes.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from hybrid_rl.colocated.engine_parts import SyncTarget, TrainedPolicy
from hybrid_rl.colocated.hybrid import HybridEngine, SwitchOptions
from hybrid_rl.distributed.fsdp import shard_model
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.distributed.offload import OffloadManager
from hybrid_rl.weightsync.layout import Layout, ModelDims
from hybrid_rl.weightsync.reshard import WeightSyncError
from hybrid_rl.weightsync.verify import HEAD
from hybrid_rl.weightsync.vllm_weights import (
    check_storages,
    load_inplace,
    model_params,
    readback,
    storage_ptrs,
    sync_path,
)
from tests.gpu.conftest import qwen_shapes, report

MIB = 2**20


class CudaVLLMWeights:
    """vLLM's side of the sync on CUDA: its parameters (dense, bf16, fused names, the head tied to the embedding
    module) and the calls `VLLMEngine` makes for a sync, landing with the product's own functions."""

    def __init__(self, layout: Layout, hf_shapes: dict[str, tuple[int, ...]]):
        rows: dict[str, tuple[int, tuple[int, ...]]] = {}
        for name, shape in hf_shapes.items():
            if layout.skip(name):
                continue
            ts = layout.slice(name, shape, 0)
            end = ts.dest_offset + ts.shape[0]
            rows[ts.vllm_name] = (max(end, rows.get(ts.vllm_name, (0,))[0]), ts.shape[1:])
        self.model = torch.nn.Module()
        for name, (n, rest) in rows.items():
            *path, leaf = name.split(".")
            module = self.model
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(n, *rest, dtype=torch.bfloat16,
                                                                           device="cuda"), requires_grad=False))
        self.model.add_module(HEAD, self.model.get_submodule("model.embed_tokens"))  # tied, as vLLM ties it
        self.started = False
        self.corrupt_next = False
        self._captured: dict[str, int] | None = None

    def start(self, pending_bytes: int = 0) -> None:
        self.started = True
        self._captured = storage_ptrs(self.model)  # CUDA graphs captured these addresses

    def weight_sync_path(self, slices) -> str:
        return sync_path(self.model, slices)

    def load_weights(self, stream, path: str) -> None:
        assert path == "inplace", path
        load_inplace(model_params(self.model), stream)
        if self.corrupt_next:  # a landing bug: one row of one weight left behind
            self.corrupt_next = False
            self.model.get_submodule("model.layers.3.mlp").down_proj.weight.data[7].zero_()
        check_storages(self._captured, storage_ptrs(self.model), sync_index=0)

    def readback(self, requests, digest) -> torch.Tensor:
        return readback(self.model, requests, digest)

    def stop(self) -> None:
        self.started = False


@pytest.fixture
def world_of_one(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


def _full_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().to(torch.bfloat16) for n, p in model.named_parameters()}


def test_one_gpu_sync_lands_fsdp_shards_cast_in_place_and_verifies_them(world_of_one, tmp_path):
    cfg, _ = qwen_shapes.config("0.5B")  # tied embeddings, 151936 x 896, q/k/v biases
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    shard_model(model, world_of_one, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    layout = Layout(ModelDims.from_hf_config(cfg), 1)
    vllm = CudaVLLMWeights(layout, {n: tuple(p.shape) for n, p in model.named_parameters()})
    options = SwitchOptions(bucket_bytes=256 * MIB, verify=True, probe_cols=64, release="keep",
                            offload_params="none", offload_grads="none", offload_optim="cpu")
    engine = HybridEngine(TrainedPolicy(model, optimizer),
                          SyncTarget(vllm, layout, device=torch.device("cuda"), dtype=torch.bfloat16),
                          dims=ParallelDims(world=1, rank=0, local_rank=0, tp=1),
                          offload=OffloadManager(tmp_path / "offload", rank=0), options=options)
    params = model_params(vllm.model)
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    syncs = []
    try:
        for step in range(3):
            torch.cuda.synchronize()
            with engine.rollout_mode():
                torch.cuda.synchronize()
                rep = engine.report
                assert rep.sync_path == "inplace" and rep.peak_buffer_bytes == 0, rep
                assert torch.cuda.memory_allocated() > 0
                full = _full_bf16(model)
                for name, w in full.items():  # every weight, bit for bit, where vLLM's forward reads it
                    ts = layout.slice(name, tuple(w.shape), 0)
                    got = params[ts.vllm_name].narrow(0, ts.dest_offset, ts.shape[0])
                    assert torch.equal(got, w), (step, name)
                assert vllm.model.get_submodule(HEAD).weight is params["model.embed_tokens.weight"]
                syncs.append({"seconds": rep.seconds["sync_weights"], "bytes": rep.bytes_received,
                              "offload_optim_s": rep.seconds["offload_train_state"]})
            model(input_ids=ids, labels=ids).loss.backward()  # the optimizer state came back from pinned memory
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        vllm.corrupt_next = True
        with pytest.raises(WeightSyncError, match="down_proj"):
            engine.enter_rollout()
        assert engine.mode.name == "TRAIN"
        state = next(iter(optimizer.state.values()))
        assert state["exp_avg"].device.type == "cuda"  # reloaded behind the failed switch
    finally:
        engine.close()

    nbytes = syncs[-1]["bytes"]
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    f32 = torch.empty(nbytes // 2, dtype=torch.float32, device="cuda")
    times = {"copy_bf16": [], "cast_f32_to_bf16": []}
    for _ in range(5):
        for key, (a, b) in {"copy_bf16": (dst, src), "cast_f32_to_bf16": (dst, f32)}.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a.copy_(b)
            torch.cuda.synchronize()
            times[key].append(time.perf_counter() - t0)
    copy_s = min(times["copy_bf16"])
    report("weight_sync_world1", {"device": torch.cuda.get_device_name(), "bytes_per_sync": nbytes,
                                  "syncs": syncs, "copy_bf16_s": copy_s,
                                  "cast_f32_to_bf16_s": min(times["cast_f32_to_bf16"]),
                                  "sync_over_copy": [round(s["seconds"] / copy_s, 1) for s in syncs]})
