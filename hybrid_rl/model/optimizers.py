"""The optimizers a run can pick (`optim.name`): how to build each and the bytes of its state per tensor.

* `adamw`: `torch.optim.AdamW` (its fused kernel), two float32 moments per parameter element.
* `adamw8bit`: torchao's `AdamW8bit` (block-wise dynamic 8-bit moments, the bitsandbytes scheme): each moment
  of a local shard with at least 4096 elements and a multiple of 256 is a uint8 code per element, a float32
  scale per block of 256 and a 256-entry float32 code table; smaller shards keep float32 moments. It works on
  FSDP2's DTensor shards (each moment is a DTensor over an `OptimState8bit` local tensor), so DCP saves and
  loads the codes and scales themselves (bitwise resume) and offload moves their storages.

torchao compiles its per-tensor update with `torch.compile`; on a GPU that is the fast path, on CPU the
first step would spend minutes compiling one kernel per shape for no gain, so there the same function runs
eagerly, over slices of whole quantisation blocks (`_eager_on_cpu`: bounded temporaries, bitwise the same).

The planner counts `state_bytes` of each trainable tensor's unpadded local shard (`memory_plan.shard_bytes`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

BLOCK = 256  # torchao's default block size: one float32 scale per 256 codes
MIN_QUANTIZED = 4096  # smaller local shards keep float32 moments (as torchao and bitsandbytes do)


@dataclass(frozen=True)
class Settings:
    lr: float
    betas: tuple[float, float]
    weight_decay: float


@dataclass(frozen=True)
class OptimizerKind:
    build: Callable[[list[torch.nn.Parameter], Settings], torch.optim.Optimizer]
    state_bytes: Callable[[int], int]  # bytes of the moments of one local shard of n elements (not the step)
    label: str  # the planner's row name


def _adamw(params: list[torch.nn.Parameter], s: Settings) -> torch.optim.Optimizer:
    # fused: one pass over each parameter and its two moments, where the default (for-loop) implementation makes
    # about ten; on CPU, where the step is memory-bound, that is 4.4x faster (17M elements, one thread), and it
    # works on FSDP2's DTensor shards. The same kernel runs at every step, so resume stays bitwise.
    return torch.optim.AdamW(params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay, fused=True)


def _adamw8bit(params: list[torch.nn.Parameter], s: Settings) -> torch.optim.Optimizer:
    return _eager_on_cpu(_torchao_adamw8bit())(params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay,
                                               block_size=BLOCK)


def _adamw_bytes(n: int) -> int:
    return 8 * n


def _adamw8bit_bytes(n: int) -> int:
    if n >= MIN_QUANTIZED and n % BLOCK == 0:
        return 2 * (n + 4 * (n // BLOCK) + 4 * 256)  # codes, scales, code table; for each of the two moments
    return 8 * n


OPTIMIZERS: dict[str, OptimizerKind] = {
    "adamw": OptimizerKind(_adamw, _adamw_bytes, "AdamW states (2 x fp32)"),
    "adamw8bit": OptimizerKind(_adamw8bit, _adamw8bit_bytes, "AdamW states (2 x 8-bit)"),
}


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float, betas: Iterable[float],
                    weight_decay: float = 0.0) -> torch.optim.Optimizer:
    b = tuple(betas)
    return OPTIMIZERS[name].build(list(params), Settings(lr, (b[0], b[1]), weight_decay))


def _torchao_adamw8bit() -> type[torch.optim.Optimizer]:
    # torchao warns at import about its CUDA-only kernels on a machine without them; nothing here uses them.
    log = logging.getLogger("torchao")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torchao.optim import AdamW8bit
    finally:
        log.setLevel(level)
    return AdamW8bit


CPU_CHUNK = 1 << 20  # elements of one eager 8-bit update on CPU (see `_eager_on_cpu`)


def _eager_on_cpu(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """torchao's 8-bit AdamW, its own per-tensor update run eagerly on CPU over slices of at most `CPU_CHUNK`
    elements.

    Eager, the update makes about forty passes over a tensor, each with a float32 or int64 temporary of the
    tensor's size (the moments' dequantised copies, the binary search of the re-quantisation): at Qwen2.5-0.5B's
    shape, two ranks, the embedding's shard alone made the update 1.5 GiB above the plan and 4x slower than AdamW.
    Slices of whole quantisation blocks (`OptimState8bit` slices along dim 0 into views of its codes and
    scales) bound those temporaries, keep them in cache and out of fresh pages, and give bitwise the result of
    the whole tensor: blocks are quantised independently and the arithmetic is element-wise."""
    from torchao.optim.adam import single_param_adam

    class EagerOnCPU(cls):  # type: ignore[misc, valid-type]
        __doc__ = cls.__doc__

        @torch.no_grad()
        def step(self, closure=None):
            if any(p.device.type != "cpu" for g in self.param_groups for p in g["params"]):
                return super().step(closure)  # torchao's compiled update, as it ships
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                if group["amsgrad"]:
                    raise ValueError("amsgrad is not supported by the chunked CPU update")
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:  # as torchao's step initialises it
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    tensors = [_local(x) for x in (p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"])]
                    for a, b in _row_slices(tensors[2], CPU_CHUNK):
                        single_param_adam(*(x[a:b] for x in tensors[:2]), state["step"],
                                          *(x[a:b] for x in tensors[2:]), None, group["lr"],
                                          group["betas"][0], group["betas"][1], group["weight_decay"],
                                          group["eps"], self.is_adamw,
                                          self.bf16_stochastic_round and p.dtype is torch.bfloat16)
            return loss

    EagerOnCPU.__name__ = EagerOnCPU.__qualname__ = cls.__name__
    return EagerOnCPU


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if hasattr(x, "to_local") else x


def _row_slices(moment: torch.Tensor, chunk: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) of at most about `chunk` elements each, cut at quantisation-block boundaries when the
    moment is 8-bit (a float32 moment: any rows)."""
    rows = moment.shape[0] if moment.dim() else 1
    if moment.dim() < 1 or moment.numel() <= chunk:
        return [(0, rows)]
    row = moment.numel() // rows
    block = getattr(moment, "block_size", 1)
    step = block // math.gcd(row, block)  # the fewest rows that end on a block boundary
    per = max(step, chunk // row // step * step)
    return [(a, min(a + per, rows)) for a in range(0, rows, per)]
