"""What a policy offers the weight sync, whatever the deployment that receives it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch

from hybrid_rl.distributed.fsdp import hf_name, local_rows, local_tensor
from hybrid_rl.model.families import FusedNames


class WeightSource(Protocol):
    """What the policy offers to sync: (HF name, this rank's dim-0 shard, full shape) per weight; the shard may be
    a function that computes it when its bucket is sent (`plan.SourceParam`)."""

    def weights(self) -> Iterable[tuple[str, torch.Tensor | Callable[[], torch.Tensor], tuple[int, ...]]]: ...

    def changed_names(self) -> set[str] | None:
        """Weights that can change between syncs (None: all). The rest is sent once."""


class ModuleWeights:
    """Every parameter of an FSDP (or plain) module, as trained, by its checkpoint names: a fused parameter
    (a mixture of experts' `experts.gate_up_proj`, `model.families`) as one weight per expert and projection,
    each a view of this rank's shard where it holds that expert (`Layout.held_rows`), else empty."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        config = getattr(module, "config", None)
        self.fused = FusedNames(config) if config is not None else None

    def weights(self) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
        for name, p in self.module.named_parameters():
            name = hf_name(name)
            if self.fused and self.fused.pieces(name) is not None:
                yield from self.fused.split(name, local_tensor(p).detach(), tuple(p.shape), local_rows(p))
            else:
                yield name, local_tensor(p).detach(), tuple(p.shape)

    def changed_names(self) -> None:
        return None
