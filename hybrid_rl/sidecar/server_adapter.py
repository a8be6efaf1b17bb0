"""`model.lora.sync=adapter` in sidecar mode: each update gives the vLLM servers the LoRA adapter alone.

The frozen base reaches every server once, through the checkpoint engine (verified by its checksums and
stamped like any update), and again only where a server lost it (a restart from dummy weights). Each
update after that is the adapter: every trainer rank gathers it (a collective), each server's leader
writes it as a peft folder (`adapter_config.json` + `adapter_model.safetensors`, in the rollout dtype)
and loads it through vLLM's runtime LoRA API (`/v1/load_lora_adapter`, served with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`) under the update's version label; requests name that label as
their model. vLLM loads adapters from a folder only, so the folder is the transport on a node; other
pods get the folder's bytes by the pod group's broadcast (`pod_link.GroupLink.adapter`) and load them
the same way.

Nothing is paused: requests in flight keep the adapter they named (asynchronous runs), so each server
keeps the newest `keep` versions loaded (`--max-loras`, sized from `rollout.max_staleness`) and their
folders on disk (vLLM may evict an adapter from its cache and read it again).

Verification: vLLM checks the adapter's modules and shapes against the model when it loads it (an adapter
that does not fit is refused), and the server must list the version among its models afterwards.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from torch import nn

from hybrid_rl.model.lora import gather_adapter, save_adapter
from hybrid_rl.sidecar.vllm_server import VLLMServer
from hybrid_rl.weightsync.reshard import WeightSyncError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


SAFE_LABEL = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"  # a version label that can only name a folder directly in the root


class AdapterFolders:
    """The adapter versions one server may still serve, each as a folder vLLM can (re)load: the newest `keep`.
    A version label is a folder name: it must match `labels` (the run's own pattern where the label comes from
    another process) and its folder must lie directly under the root, or nothing is written or deleted."""

    def __init__(self, root: str | Path, *, keep: int, labels: str = SAFE_LABEL):
        self.root, self.keep, self.labels = Path(root), keep, re.compile(labels)
        self.versions: list[str] = []

    def path(self, version: str) -> Path:
        path = self.root / version
        if not (self.labels.fullmatch(version) and re.fullmatch(SAFE_LABEL, version)) \
                or path.resolve().parent != self.root.resolve():
            raise WeightSyncError(f"adapter version label {version!r} refused: not of this run's form "
                                  f"({self.labels.pattern}) or not a folder directly under {self.root}")
        return path

    def add(self, version: str) -> list[str]:
        """`version`'s folder is written: it joins; returns the versions that fall out (their folders deleted)."""
        if version in self.versions:
            self.versions.remove(version)
        self.versions.append(version)
        old, self.versions = self.versions[:-self.keep], self.versions[-self.keep:]
        for v in old:
            shutil.rmtree(self.path(v), ignore_errors=True)
        return old

    def write_files(self, version: str, files: dict[str, bytes]) -> Path:
        path = self.path(version)
        path.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            if name not in ADAPTER_FILES:
                raise WeightSyncError(f"adapter file {name!r} is not one of {ADAPTER_FILES}")
            (path / name).write_bytes(data)
        return path

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def read_files(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in ADAPTER_FILES}


def load_on_server(server: VLLMServer, folders: AdapterFolders, version: str, *, timeout_s: float) -> None:
    """Load `version` (its folder written) into `server` under its label; unload the versions that fall out.
    ServerError when the server refuses it, WeightSyncError when it does not list it afterwards."""
    if version not in served_models(server):  # (a recovery pushes the current version again: loaded already)
        server.post("/v1/load_lora_adapter", {"lora_name": version, "lora_path": str(folders.path(version))},
                    timeout_s=timeout_s)
    served = served_models(server)
    if version not in served:
        raise WeightSyncError(f"the vLLM server at {server.url} does not list adapter {version} after loading it")
    # Its weight version says the newest policy it serves (each request's tokens are its named adapter's anyway).
    server.post("/update_weight_version", {"new_version": version}, timeout_s=timeout_s)
    for old in folders.add(version):
        if old in served:
            server.post("/v1/unload_lora_adapter", {"lora_name": old}, timeout_s=timeout_s)


def served_models(server: VLLMServer) -> set[str]:
    """The names the server answers to: its base and the adapters loaded."""
    return {m["id"] for m in server.get("/v1/models").get("data", [])}


class AdapterPublisher:
    """Trainer side: gathers the actor's adapter (every rank) and writes it for this rank's server (a leader) and
    for the other pods (rank 0, when there are any)."""

    def __init__(self, model: nn.Module, root: str | Path, *, index: int, dtype: torch.dtype, keep: int):
        self.model, self.dtype = model, dtype
        self.folders = AdapterFolders(Path(root) / f"server{index}", keep=keep)

    def write(self, version: str, *, writes: bool) -> tuple[Path | None, int]:
        """Collective: gather the adapter; where `writes`, write its folder. (folder or None, the tensors' bytes)."""
        full = {k: v.to(self.dtype) for k, v in gather_adapter(self.model).items()}
        nbytes = sum(t.numel() * t.element_size() for t in full.values())
        if not writes:
            return None, nbytes
        path = self.folders.path(version)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        save_adapter(self.model, full, path)
        return path, nbytes

    def close(self) -> None:
        self.folders.close()
