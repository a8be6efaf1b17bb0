"""The project's vLLM plugin (entry point `vllm.general_plugins` -> `hybrid_rl = hybrid_rl.sidecar.vllm_plugin:register`).

vLLM loads general plugins in every process it starts (API server, engine core, workers), so a stock
vLLM server knows the checkpoint engine's weight-transfer backend without any patch to vLLM. The
entry point needs installed package metadata: `make install` installs the project (`pip install -e .`).
Registration is by module path, so the backend's own module is imported only when vLLM builds it.
"""

from __future__ import annotations

BACKEND = "hybrid_rl_shm"  # the weight-transfer backend's name (`--weight-transfer-config '{"backend": ...}'`)


def register() -> None:
    from hybrid_rl.weightsync.vllm_landing import register_backend

    register_backend(BACKEND, "hybrid_rl.sidecar.shm_transfer", "ShmTransfer")
