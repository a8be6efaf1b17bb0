"""CUDA-only branches of single components, on the GPU: offload through pinned buffers, and the packed attention
with the fused SDPA kernels (on CPU short sequences take the math kernel; on CUDA every sequence takes a fused one).
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybrid_rl.data import pack
from hybrid_rl.distributed.offload import OffloadManager, optimizer_tensors, param_tensors
from hybrid_rl.model.attention import register
from tests.gpu.conftest import SHAPES, report

GIB = 2**30


def _qwen(layers: int, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(**{**SHAPES["0.5B"], "num_hidden_layers": layers, "vocab_size": 4096}, use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg).to("cuda", dtype)
    model.set_attn_implementation(attn)
    return model


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_offload_frees_the_device_and_brings_back_every_byte(target, tmp_path):
    """A model with AdamW state after one step: offloading its parameters and optimizer state frees their device
    memory (measured by the allocator), reloading restores them bitwise, a second round reuses the pinned buffer,
    and training goes on from them."""
    model = _qwen(4, torch.float32, "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 4096, (2, 64), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = [t.clone() for t in optimizer_tensors(opt)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated()

    manager = OffloadManager(tmp_path / "offload")
    figures = {"target": target}
    for round_ in range(2):
        t0 = time.perf_counter()
        freed = manager.offload("actor", param_tensors(model), target)
        freed += manager.offload("actor.optim", optimizer_tensors(opt), target)
        offload_s = time.perf_counter() - t0
        after = torch.cuda.memory_allocated()
        assert resident - after >= 0.99 * freed > 0, (resident, after, freed)  # AdamW's step counts stay on the host
        if target == "cpu":
            assert manager._host["actor"].pinned and manager._host["actor"].tensor.is_pinned()
        host_buffer = manager._host.get("actor")
        t0 = time.perf_counter()
        manager.reload("actor")
        manager.reload("actor.optim")
        reload_s = time.perf_counter() - t0
        # back to what it was, up to the caching allocator's rounding of blocks (it depends on which blocks are free)
        assert abs(torch.cuda.memory_allocated() - resident) < 0.01 * freed
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
        for a, b in zip(optimizer_tensors(opt), state, strict=True):
            assert torch.equal(a, b)
        if round_ == 1 and target == "cpu":
            assert manager._host["actor"] is host_buffer  # registered once, reused
        figures[f"round{round_}"] = {"freed_gib": freed / GIB, "offload_gb_s": freed / offload_s / 1e9,
                                     "reload_gb_s": freed / reload_s / 1e9}
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    manager.close()
    report(f"offload_{target}", figures)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_attention_equals_each_sequence_alone_on_cuda(dtype):
    """Qwen2.5-0.5B's heads (14 query, 2 KV, GQA): a packed row's logits and gradients equal each sequence run alone
    with transformers' own SDPA, including one-token sequences and ones longer than the CPU's math-kernel limit."""
    lengths = (5, 1, 64, 300, 1, 30, 129)
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 4096, (n,), generator=g) for n in lengths]
    weights = torch.randn(sum(lengths), 4096, generator=g).to("cuda", dtype)

    packed_model = _qwen(2, dtype, register())
    batch = pack(sequences)
    packed = packed_model(input_ids=batch.input_ids.cuda(), position_ids=batch.position_ids.cuda(),
                          use_cache=False).logits[0]
    (packed.float() * weights).sum().backward()

    alone_model = _qwen(2, dtype, "sdpa")
    alone = torch.cat([alone_model(input_ids=s[None].cuda(), use_cache=False).logits[0] for s in sequences])
    (alone.float() * weights).sum().backward()

    tol = dict(rtol=0, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=0, atol=1e-4)
    torch.testing.assert_close(packed.float(), alone.float(), **tol)
    worst = 0.0
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters(), strict=True):
        rel = ((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp(min=1e-12)).item()
        worst = max(worst, rel)
        assert rel < (5e-2 if dtype == torch.bfloat16 else 1e-4), (name, rel)
    report(f"packed_attention_{str(dtype).split('.')[-1]}", {"max_grad_rel_err": worst,
                                                              "max_logit_abs_err": (packed - alone).abs().max().item()})
