"""`model.lora.sync=adapter`: each update gives vLLM the LoRA adapter alone, as a new adapter version.

The frozen base weights reach vLLM once, by the ordinary weight sync (`model.lora.BaseWeights`); after that
every sync gathers the adapter's tensors (a few MB where merged sync sends every adapted layer whole), writes
them as a peft adapter folder (`adapter_config.json` + `adapter_model.safetensors`, in the rollout dtype) and
has vLLM load it under a new LoRA id through its public LoRA API (`LoRARequest`, `add_lora`); generation then
names that version. vLLM 0.32 loads adapters from a folder only, so the folder is the transport: one per rank
(ranks may sit on different nodes), the previous version's deleted once the new one is loaded. vLLM slices
the adapter for its TP rank itself, as it does for any adapter it loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from hybrid_rl.colocated.vllm_engine import VLLMEngine
from hybrid_rl.model.lora import gather_adapter, save_adapter


class AdapterSync:
    """Publishes the actor's adapter to this rank's vLLM, one version per sync."""

    def __init__(self, model: nn.Module, root: str | Path, *, rank: int, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.root = Path(root) / f"rank{rank}"
        self._current: Path | None = None
        self.version = -1  # of the last adapter published; each publish is a new one (vLLM caches adapters by id)

    def publish(self, vllm: VLLMEngine) -> int:
        """Collective (every rank gathers the adapter): write the next version, load it into vLLM, make it the
        one generation uses. Returns the bytes this rank handed to vLLM."""
        self.version += 1
        version = self.version
        full = {k: v.to(self.dtype) for k, v in gather_adapter(self.model).items()}
        path = self.root / f"v{version}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        save_adapter(self.model, full, path)
        vllm.set_adapter(version, str(path))
        if self._current is not None and self._current != path:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = path
        return sum(t.numel() * t.element_size() for t in full.values())

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
