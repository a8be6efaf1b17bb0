"""The 8-bit AdamW's CPU update runs torchao's own per-tensor function over flat slices of whole quantisation blocks:
eagerly, bitwise what torchao's step gives on the whole tensors, no call over more elements than the bound; compiled
(every full slice), the same within float32 rounding."""

from __future__ import annotations

import torch
import torchao.optim.adam as torchao_adam
from torchao.optim import AdamW8bit

from hybrid_rl.model import optimizers

SHAPES = [(130, 896), (37, 100), (64,), (3, 4096)]  # 130x896 and 3x4096 are 8-bit; 37x100 and 64 stay float32
CHUNK = 2048  # 8 quantisation blocks


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 3) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _ours(monkeypatch, *, compile: bool) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    monkeypatch.setattr(optimizers, "CPU_CHUNK", CHUNK)
    monkeypatch.setattr(optimizers, "CPU_COMPILE", compile)
    params = _params()
    opt = optimizers.build_optimizer("adamw8bit", params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    _train(opt, params)
    return params, opt


def _torchaos() -> list[torch.nn.Parameter]:
    params = _params()
    with torch.compiler.set_stance("force_eager"):
        _train(AdamW8bit(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, block_size=256), params)
    return params


def test_eager_sliced_update_is_bitwise_torchaos_whole_tensor_update(monkeypatch):
    calls = []
    real = torchao_adam.single_param_adam
    monkeypatch.setattr(torchao_adam, "single_param_adam", lambda p, *a: calls.append(p.numel()) or real(p, *a))
    ours, opt = _ours(monkeypatch, compile=False)
    ours_calls = list(calls)

    assert all(torch.equal(a, b) for a, b in zip(ours, _torchaos(), strict=True))
    assert type(opt.state[ours[0]]["exp_avg"]).__name__ == "OptimState8bit"  # the slices really were 8-bit
    assert max(ours_calls) == CHUNK and len(ours_calls) > 3 * len(SHAPES)  # bounded, and the large tensors cut


def test_compiled_full_slices_give_the_eager_result(monkeypatch):
    ours, opt = _ours(monkeypatch, compile=True)
    for a, b in zip(ours, _torchaos(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    state = opt.state[ours[0]]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the full slices went through the compiler
