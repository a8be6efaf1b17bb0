"""The optimizers a run can pick (`optim.name`): how to build each and the bytes of its state per tensor.

* `adamw`: `torch.optim.AdamW`, two float32 moments per parameter element.
* `adamw8bit`: torchao's `AdamW8bit` (block-wise dynamic 8-bit moments, the bitsandbytes scheme): each moment
  of a local shard with at least 4096 elements and a multiple of 256 is a uint8 code per element, a float32
  scale per block of 256 and a 256-entry float32 code table; smaller shards keep float32 moments. It works on
  FSDP2's DTensor shards (each moment is a DTensor over an `OptimState8bit` local tensor), so DCP saves and
  loads the codes and scales themselves (bitwise resume) and offload moves their storages.

torchao compiles its per-tensor update with `torch.compile`; on a GPU that is the fast path, on CPU the
first step would spend minutes compiling one kernel per shape for no gain, so there the update runs eagerly
(the same function, `torch.compiler.set_stance("force_eager")`).

The planner counts `state_bytes` of each trainable tensor's unpadded local shard (`memory_plan.shard_bytes`).
"""

from __future__ import annotations

import logging
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
    return torch.optim.AdamW(params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)


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


def _eager_on_cpu(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    class EagerOnCPU(cls):  # type: ignore[misc, valid-type]
        __doc__ = cls.__doc__

        @torch.no_grad()
        def step(self, closure=None):
            if any(p.device.type != "cpu" for g in self.param_groups for p in g["params"]):
                return super().step(closure)
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)

    EagerOnCPU.__name__ = EagerOnCPU.__qualname__ = cls.__name__
    return EagerOnCPU
