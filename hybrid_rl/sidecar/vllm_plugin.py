"""The project's vLLM plugin (entry point `vllm.general_plugins` -> `hybrid_rl = hybrid_rl.sidecar.vllm_plugin:register`).

vLLM loads general plugins in every process it starts (API server, engine core, workers), so a stock
vLLM server knows the checkpoint engine's weight-transfer backend without any patch to vLLM. The
entry point needs installed package metadata: `make install` writes it (`scripts/write_dist_info.py`).
Registration is by module path, so nothing heavy is imported until vLLM builds the backend.
"""

from __future__ import annotations

BACKEND = "hybrid_rl_shm"  # the weight-transfer backend's name (`--weight-transfer-config '{"backend": ...}'`)


def register() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "hybrid_rl.sidecar.shm_transfer", "ShmTransfer")
    except ValueError as e:  # vLLM may call plugins more than once per process
        if "already registered" not in str(e):
            raise
