"""The 8-bit AdamW's CPU update runs torchao's own per-tensor function over slices of whole quantisation blocks:
bitwise what torchao's step gives on the whole tensors, with no call over more elements than the bound allows."""

from __future__ import annotations

import pytest
import torch
import torchao.optim.adam as torchao_adam
from torchao.optim import AdamW8bit

from hybrid_rl.model import optimizers

SHAPES = [(130, 896), (37, 100), (64,), (3, 4096)]  # 896 is 3.5 blocks a row; 37x100 and 64 stay float32


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 3) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_sliced_update_is_bitwise_torchaos_whole_tensor_update(monkeypatch):
    calls = []
    real = torchao_adam.single_param_adam
    monkeypatch.setattr(torchao_adam, "single_param_adam", lambda p, *a: calls.append(p.numel()) or real(p, *a))
    monkeypatch.setattr(optimizers, "CPU_CHUNK", 3000)
    ours = _params()
    opt = optimizers.build_optimizer("adamw8bit", ours, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    _train(opt, ours)
    ours_calls = list(calls)

    theirs = _params()
    with torch.compiler.set_stance("force_eager"):
        _train(AdamW8bit(theirs, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, block_size=256), theirs)

    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    codes = opt.state[ours[0]]["exp_avg"]
    assert type(codes).__name__ == "OptimState8bit"  # the sliced tensors really were 8-bit
    # a slice is whole rows ending on a block boundary: within the bound, or the fewest such rows (one 4096-long row)
    assert max(ours_calls) == 4096
    assert len(ours_calls) > 3 * len(SHAPES)  # and the large tensors were cut


@pytest.mark.parametrize("shape", [(130, 896), (7, 4096), (8192,)])
def test_row_slices_cover_the_tensor_on_block_boundaries(shape):
    opt = optimizers.build_optimizer("adamw8bit", [torch.nn.Parameter(torch.zeros(shape))], lr=1e-3,
                                     betas=(0.9, 0.99))
    moment = opt._new_buffer(opt.param_groups[0]["params"][0], True)
    row = moment.numel() // moment.shape[0]
    slices = optimizers._row_slices(moment, 1000)
    assert slices[0][0] == 0 and slices[-1][1] == shape[0]
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(slices, slices[1:], strict=False))
    assert all(a * row % 256 == 0 for a, _ in slices)
