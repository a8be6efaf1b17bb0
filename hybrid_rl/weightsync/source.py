"""What a policy offers the weight sync, whatever the deployment that receives it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch

from hybrid_rl.distributed.fsdp import hf_name, local_tensor


class WeightSource(Protocol):
    """What the policy offers to sync: (HF name, this rank's dim-0 shard, full shape) per weight; the shard may be
    a function that computes it when its bucket is sent (`reshard.SourceParam`)."""

    def weights(self) -> Iterable[tuple[str, torch.Tensor | Callable[[], torch.Tensor], tuple[int, ...]]]: ...

    def changed_names(self) -> set[str] | None:
        """Weights that can change between syncs (None: all). The rest is sent once."""


class ModuleWeights:
    """Every parameter of an FSDP (or plain) module, as trained."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def weights(self) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
        for name, p in self.module.named_parameters():
            yield hf_name(name), local_tensor(p).detach(), tuple(p.shape)

    def changed_names(self) -> None:
        return None
