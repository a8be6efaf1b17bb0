"""The weight-sync backend plugged into vLLM's public weight-transfer API.

vLLM 0.32's `vllm.distributed.weight_transfer` runs a sync as a session on each worker:
`init_weight_transfer_engine` (once per engine) -> `start_weight_update` -> `update_weights` (per
chunk) -> `finish_weight_update`, with the transport left to a pluggable `WeightTransferEngine`
chosen by `weight_transfer_config.backend`. Here the trainer and vLLM's worker share one process,
so there is nothing to transport: `update_weights` gets the resharder's stream of `(TPSlice, tensor)`
by reference (`collective_rpc` is a direct call in-process) and lands it with `vllm_weights`.

This module imports vLLM at the top: vLLM's factory imports it by name inside the worker, and
`VLLMEngine.start()` registers it just before building the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybrid_rl.weightsync.layout import TPSlice
from hybrid_rl.weightsync.vllm_landing import LandingEngine, register_backend
from hybrid_rl.weightsync.vllm_weights import items_of, load_inplace, load_packed, model_params, staged

BACKEND = "hybrid_rl_inprocess"
PATHS = ("inplace", "packed", "reload")


@dataclass
class InitInfo:
    path: str  # inplace | packed | reload (see vllm_weights)

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"weight sync path must be one of {PATHS}, got {self.path!r}")


@dataclass
class UpdateInfo:
    stream: Iterable[tuple[TPSlice, torch.Tensor] | list[tuple[TPSlice, torch.Tensor]]]  # slices or whole buckets


class InProcessTransfer(LandingEngine):
    """Lands the resharder's slices in vLLM's model, in place or through vLLM's layerwise reload."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.path: str | None = None

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        self.path = init_info.path

    def start_weight_update(self) -> None:
        if self.path is None:
            raise RuntimeError("init_weight_transfer_engine must name the sync path before the first update")
        self.begin_landing()

    def receive_weights(self, update_info: UpdateInfo) -> None:
        if self.path == "inplace":
            load_inplace(model_params(self.model), update_info.stream)
        elif self.path == "packed":
            load_packed(self.model, update_info.stream)
        else:
            self.model.load_weights(staged(ts, t) for ts, t in items_of(update_info.stream))

    def finish_weight_update(self) -> None:
        self.end_landing()

    def shutdown(self) -> None:
        self.path = None


def register() -> None:
    """Make BACKEND known to vLLM's factory (once per process; engines restart)."""
    register_backend(BACKEND, __name__, InProcessTransfer.__name__)
