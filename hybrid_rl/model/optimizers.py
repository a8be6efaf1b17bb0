"""The optimizers a run can pick (`optim.name`): how to build each and the bytes of its state per tensor.

* `adamw`: `torch.optim.AdamW` (its fused kernel), two float32 moments per parameter element.
* `adamw8bit`: torchao's `AdamW8bit` (block-wise dynamic 8-bit moments, the bitsandbytes scheme): each moment
  of a local shard with at least 4096 elements and a multiple of 256 is a uint8 code per element, a float32
  scale per block of 256 and a 256-entry float32 code table; smaller shards keep float32 moments. It works on
  FSDP2's DTensor shards (each moment is a DTensor over an `OptimState8bit` local tensor), so DCP saves and
  loads the codes and scales themselves (bitwise resume) and offload moves their storages.

torchao compiles its per-tensor update with `torch.compile`; on a GPU that is the fast path, on CPU the
first step would compile one kernel per tensor shape, so there the same function runs over flat slices of a fixed
size (`_eager_on_cpu`: bounded temporaries, one compiled kernel for every full slice, the tails eager).

The planner counts `state_bytes` of each trainable tensor's unpadded local shard (`planner/shards.shard_bytes`).
"""

from __future__ import annotations

import logging
import shutil
import weakref
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


_KINDS: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerKind] = weakref.WeakKeyDictionary()


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float, betas: Iterable[float],
                    weight_decay: float = 0.0) -> torch.optim.Optimizer:
    b = tuple(betas)
    optimizer = OPTIMIZERS[name].build(list(params), Settings(lr, (b[0], b[1]), weight_decay))
    _KINDS[optimizer] = OPTIMIZERS[name]
    return optimizer


def state_to_come(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state not created yet: the moments of every trainable parameter without state, at the
    size its kind stores them (`state_bytes` of the local shard: 8-bit moments at about a quarter of AdamW's).
    torch and torchao create them in the first `step()`; what is planned around them before then (vLLM's share
    of the GPU) must count them, or the next rollout cannot fit. An optimizer not built here counts as AdamW."""
    kind = _KINDS.get(optimizer, OPTIMIZERS["adamw"])
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and not optimizer.state.get(p):
                total += kind.state_bytes((p.to_local() if hasattr(p, "to_local") else p).numel())
    return total


def resident_state_to_come(resident: Iterable[tuple[torch.optim.Optimizer, str]], device: torch.device) -> int:
    """`state_to_come` of the optimizers whose state will be on `device` during rollouts: of `(optimizer, offload
    target)` pairs (the actor's with `offload.actor_optim`, the critic's with `offload.critic`), those not moved off
    a GPU for rollouts (`none`; on CPU offloading frees nothing a share is measured from)."""
    return sum(state_to_come(opt) for opt, offload in resident if device.type != "cuda" or offload == "none")


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


CPU_CHUNK = 1 << 20  # elements of one 8-bit update call on CPU, a whole number of quantisation blocks (see below)
CPU_COMPILE = True  # compile the update of a full chunk on CPU (one shape: one compilation per process, cached)
log = logging.getLogger(__name__)


def _eager_on_cpu(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """torchao's 8-bit AdamW on CPU: its own per-tensor update over flat slices of `CPU_CHUNK` elements.

    Run on whole tensors, the update makes about forty passes over each, with a float32 or int64 temporary of the
    tensor's size (the moments' dequantised copies, the binary search of the re-quantisation): at Qwen2.5-0.5B's
    shape, two ranks, the embedding's shard alone put the update phase 1.5 GiB over its plan. Flat slices of whole
    quantisation blocks (an `OptimState8bit` viewed 1-D and sliced is a view of its codes and scales) bound those
    temporaries and give the same result as the whole tensor: blocks are quantised independently and the
    arithmetic is element-wise. Every full slice has the same shape, so torch.compile builds one kernel for them
    all (about 20 s once per process on 2 cores, then cached by inductor; 5.6x the eager update on 16M elements);
    the short tails and small tensors run eagerly. Without a C++ compiler (inductor's), or where compiling fails,
    it says so once and runs eagerly."""
    from torchao.optim.adam import single_param_adam

    compiled: dict[str, object] = {}

    def full_chunk_update(*args) -> None:
        fn = compiled.get("fn")
        if fn is None and CPU_COMPILE and "failed" not in compiled:
            if shutil.which("c++") or shutil.which("g++"):  # inductor builds C++ kernels
                fn = compiled["fn"] = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
            else:
                compiled["failed"] = True
                log.warning("8-bit AdamW: no C++ compiler on this machine, so its CPU update runs eagerly (slower)")
        if fn is not None:
            try:
                # The CPU runtime defaults disable torch.compile (TORCH_COMPILE_DISABLE, for vLLM's helpers): this
                # one function is compiled on purpose. A compile error is raised before the graph runs, so the
                # eager call below is the chunk's only update.
                with torch._dynamo.config.patch(disable=False):
                    return fn(*args)
            except Exception as e:
                log.warning("8-bit AdamW: compiling the CPU update failed (%s); it runs eagerly (slower)",
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                compiled.pop("fn")
                compiled["failed"] = True
        return single_param_adam(*args)

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
                    param, grad, m, v = (_flat(x) for x in (p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"]))
                    rest = (None, group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"],
                            group["eps"], self.is_adamw, self.bf16_stochastic_round and p.dtype is torch.bfloat16)
                    n = param.numel()
                    for a in range(0, n, CPU_CHUNK):
                        b = min(a + CPU_CHUNK, n)
                        update = full_chunk_update if b - a == CPU_CHUNK else single_param_adam
                        update(param[a:b], grad[a:b], state["step"], m[a:b], v[a:b], *rest)
            return loss

    EagerOnCPU.__name__ = EagerOnCPU.__qualname__ = cls.__name__
    return EagerOnCPU


def _flat(x: torch.Tensor) -> torch.Tensor:
    """The local shard as a 1-D view (the update writes through it into the parameter and its moments)."""
    x = x.to_local() if hasattr(x, "to_local") else x
    if not x.is_contiguous():
        raise ValueError(f"8-bit AdamW's CPU update needs contiguous shards, got strides {x.stride()}")
    return x.view(-1)
