"""The checkpoint engine across pods: the training pod's writers broadcast each update to the other pods.

Trainer side (`GroupLink`, the `PodLink` of `checkpoint_engine.py`): for every update, writer 0 sends a
header (update number, version), each writer r its TP rank's shard manifest, then per bucket a control
message from writer 0 (`{"bucket": k}`) and the bucket from each writer (the bytes of its shared-memory
slot), then the end marker and the senders' checksums; writer 0 learns which pods verified the update.
A pod that failed to load it is left out of dispatch (its registration keeps no version) until a later
update succeeds; the run goes on with the others.

When the trainer abandons an update (its own server failed mid-update), writer 0 sends `{"abort": why}`
where the next control message was due; every receiver drops the partial update (its server, holding
partly new weights, stays paused and out of dispatch: `ServerUpdate.end(ok=False)`) and waits for the
next header, which is the trainer's retry. Without it the retry's header would meet receivers still
waiting for buckets.

Pod side (`PodReceiver`, run by `python -m hybrid_rl.pod`): receives straight into its own rings'
slots (its own shared-memory namespace), drives its own server through the same HTTP session as the
trainer's rank 0 (`server_update.py`), verifies the server's reports against the senders' checksums
and stamps the version.
"""

from __future__ import annotations

import logging

import torch

from hybrid_rl.distributed.collectives import all_gather_object, broadcast_object
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.errors import RolloutError
from hybrid_rl.sidecar.etcd import Etcd
from hybrid_rl.sidecar.pod_group import PodGroup, bounded, payload_device_for, pod_store
from hybrid_rl.sidecar.server_adapter import ADAPTER_FILES, AdapterFolders, load_on_server
from hybrid_rl.sidecar.server_update import ServerUpdate
from hybrid_rl.sidecar.shm_ring import Manifest, RingAborted, RingTimeout, ShmRing, bucket_bytes, write_manifest
from hybrid_rl.sidecar.sidecar_server import Sidecar
from hybrid_rl.sidecar.vllm_server import ServerError
from hybrid_rl.weightsync.reshard import WeightSyncError
from hybrid_rl.weightsync.verify import checksums_match

log = logging.getLogger(__name__)

GROUP_KEY = "pods/group"
MAX_ADAPTER_FILE_BYTES = 16 * 2**30  # one adapter file announced larger than this is refused before any allocation


class GroupLink:
    """Trainer side: what writer r publishes also goes to every other pod (no-ops on the other ranks)."""

    def __init__(self, group: PodGroup | None, tp: int):
        self.group, self.tp = group, tp

    def begin(self, update: int, version: str, manifest: Manifest, rank: int) -> None:
        if rank == 0:
            self.group.broadcast_json(0, {"update": update, "version": version})
        if rank < self.tp:
            self.group.broadcast_json(rank, manifest.to_json())

    def send(self, tp_rank: int, k: int, data: torch.Tensor) -> None:
        """Bucket k of writer `tp_rank` (every writer sends every bucket, scratch after a failure: the update is
        then aborted at the next control message)."""
        if tp_rank == 0:
            self.group.broadcast_json(0, {"bucket": k})
        self.group.broadcast_weights(tp_rank, data)

    def abort(self, rank: int, why: str) -> None:
        if rank == 0:
            self.group.broadcast_json(0, {"abort": why})

    def end(self, expected: torch.Tensor, rank: int) -> None:
        if rank >= self.tp:
            return
        if rank == 0:
            self.group.broadcast_json(0, {"end": True})
        self.group.broadcast(rank, expected.double().cpu().contiguous())
        if rank == 0:
            oks = self.group.all_values(1.0)
            for pod, ok in enumerate(oks[1:], start=1):
                if not ok:
                    log.warning("pod %d did not load the update (see its log): it gets no requests until it does", pod)

    def adapter(self, version: str, files: dict[str, bytes] | None, rank: int) -> None:
        """An adapter-only update (`model.lora.sync=adapter`): writer 0 sends the adapter's files (a few MB) to every
        pod, which loads them into its server; pods that could not are left out of dispatch until they do."""
        if rank != 0:
            return
        self.group.broadcast_json(0, {"adapter": version, "files": {n: len(b) for n, b in files.items()}})
        for data in files.values():
            self.group.broadcast_weights(0, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        for pod, ok in enumerate(self.group.all_values(1.0)[1:], start=1):
            if not ok:
                log.warning("pod %d did not load adapter %s (see its log): it gets no requests until it does", pod,
                            version)

    def close(self, rank: int) -> None:
        if rank == 0:
            self.group.broadcast_json(0, {"stop": True})


def pod_link(etcd: Etcd, dims: ParallelDims, *, host: str, tp: int, pods: int, wait_s: float,
             op_timeout_s: float) -> GroupLink:
    """Trainer side, every rank: writer 0 hosts the groups' store and publishes it in etcd; the writers join
    (blocking until every other pod's receiver has joined, `sidecar.pod_wait_s` at most). Each later operation of
    the group may take `op_timeout_s` (`sidecar.pod_timeout_s`: a pod waits a whole training step for the next
    update; a stalled update is caught sooner by the rings' `sidecar.update_timeout_s`)."""
    store = None
    if dims.rank == 0:
        store = pod_store(host, 0, member=0, tp=tp, pods=pods, timeout_s=wait_s)
        etcd.put(GROUP_KEY, {"host": host, "port": store.port, "tp": tp, "pods": pods})
        log.info("waiting up to %.0f s for %d other pod(s) to join (python -m hybrid_rl.pod ...)", wait_s, pods - 1)
    port = broadcast_object(store.port if store is not None else None)
    group, error = None, ""
    if dims.rank < tp:
        try:
            store = store or pod_store(host, port, member=dims.rank, tp=tp, pods=pods, timeout_s=wait_s)
            device = payload_device_for(cuda=torch.cuda.is_available(), local_rank=dims.local_rank)
            group = PodGroup(store, member=dims.rank, tp=tp, pods=pods, timeout_s=op_timeout_s,
                             payload_device=device, join_timeout_s=wait_s)
        except (TimeoutError, RuntimeError) as e:  # a pod that never joined: every rank stops, not just the writers
            error = str(e)
    errors = [e for e in all_gather_object(error) if e]
    if errors:
        raise RolloutError(errors[0])
    return GroupLink(group, tp)


class PodReceiver:
    """Pod side: every update the trainer broadcasts lands in this pod's server, verified and stamped."""

    def __init__(self, group: PodGroup, sidecar: Sidecar, *, namespace: str, slots: int, timeout_s: float,
                 adapters: AdapterFolders | None = None):
        self.group, self.sidecar, self.namespace = group, sidecar, namespace
        self.adapters = adapters  # `model.lora.sync=adapter`: where this pod keeps the adapter versions it serves
        self.base = False  # the server holds the trainer's base weights (a full update landed since its start)
        self.slots, self.timeout_s, self.tp = slots, timeout_s, group.tp
        self.rings: list[ShmRing] = []
        self.http = ServerUpdate(namespace, timeout_s=timeout_s)
        self.seq = 0
        self.updates = 0

    def run(self) -> None:
        """Receive updates until the trainer says stop."""
        while True:
            header = self.group.broadcast_json(0)
            if header.get("stop"):
                log.info("the trainer is done: pod stops")
                return
            if "adapter" in header:
                self.receive_adapter(header["adapter"], header["files"])
            else:
                self.receive(header["update"], header["version"])

    def receive(self, update: int, version: str) -> bool:
        manifests = [Manifest.from_json(self.group.broadcast_json(r)) for r in range(self.tp)]
        self.sidecar.ensure_running()
        self.base = False  # until this update lands whole
        self._rings(manifests)
        for ring, m in zip(self.rings, manifests, strict=True):
            ring.reset()
            write_manifest(ring, m)
        self.http.begin(self.sidecar.server)
        failed = ""
        for k in range(len(manifests[0].buckets)):
            if (why := self.group.broadcast_json(0).get("abort")) is not None:
                return self._aborted(version, why)
            self.seq += 1
            for r, (ring, m) in enumerate(zip(self.rings, manifests, strict=True)):
                failed = self._receive_bucket(r, ring, m, k, failed)
            if not failed:
                self.http.bucket(self.seq, k)
        if (why := self.group.broadcast_json(0).get("abort")) is not None:
            return self._aborted(version, why)
        failed = failed or self.http.finish()
        ok = not failed
        for r, (ring, m) in enumerate(zip(self.rings, manifests, strict=True)):
            expected = torch.empty(len(m.targets()), dtype=torch.float64)
            self.group.broadcast(r, expected)
            ok = ok and bool(checksums_match(expected, ring.read_report(update)).all())
        if ok:  # stamped and registered before the trainer hears back: its next dispatch sees this pod
            self.base = True
            self.http.stamp(version)
            self.sidecar.loaded(version)
            log.info("pod %d: weights %s loaded and verified", self.sidecar.pod, version)
        else:
            self.sidecar.withdraw()
            log.error("pod %d: update %s did not load (%s); withdrawn from dispatch", self.sidecar.pod, version,
                      failed or "checksum mismatch")
        if error := self.http.end(ok=ok):
            log.warning("pod %d after update %s (resuming generation): %s", self.sidecar.pod, version, error)
        self.group.all_values(float(ok))
        self.updates += 1
        return ok

    def receive_adapter(self, version: str, sizes: dict[str, int]) -> bool:
        """An adapter-only update: its files from the trainer, loaded into this pod's server under `version`. A
        server that lost its base since the last full update (restarted from dummy weights) refuses it and stays
        out of dispatch: the trainer then sends the base again (it pushes everything when a server is behind)."""
        files = {}
        if set(sizes) - set(ADAPTER_FILES) or len(sizes) != len(ADAPTER_FILES):
            raise ValueError(f"adapter update {version!r} announces files {sorted(sizes)}, not {list(ADAPTER_FILES)}")
        for name, n in sizes.items():
            buf = torch.empty(bounded(int(n), MAX_ADAPTER_FILE_BYTES, f"adapter file {name!r}"), dtype=torch.uint8)
            self.group.broadcast_weights(0, buf)
            files[name] = bytes(buf.numpy())
        why = ""
        try:
            if self.sidecar.ensure_running() or not self.base:
                self.base = False
                why = "its server holds no base weights (started since the last full update)"
            elif self.adapters is None:
                why = "this pod was started without model.lora.sync=adapter"
            else:
                self.adapters.write_files(version, files)
                load_on_server(self.sidecar.server, self.adapters, version, timeout_s=self.timeout_s)
        except (ServerError, WeightSyncError, OSError) as e:
            why = str(e)
        if not why:
            self.sidecar.loaded(version)
            log.info("pod %d: adapter %s loaded (%d bytes received)", self.sidecar.pod, version, sum(sizes.values()))
        else:
            self.sidecar.withdraw()
            log.error("pod %d: adapter %s did not load (%s); withdrawn from dispatch", self.sidecar.pod, version, why)
        self.group.all_values(float(not why))
        return not why

    def _aborted(self, version: str, why: str) -> bool:
        """The trainer abandoned the update: drop it. The server's weights are partly new under the old label, so it
        stays paused (its requests aborted) and out of dispatch until a full verified update lands."""
        self.http.error(wait=True)  # let the buckets already asked for finish (their errors do not matter now)
        self.sidecar.withdraw()
        if error := self.http.end(ok=False):
            log.warning("pod %d after the abandoned update %s: %s", self.sidecar.pod, version, error)
        log.warning("pod %d: the trainer abandoned update %s (%s); withdrawn until the next one", self.sidecar.pod,
                    version, why)
        self.updates += 1
        return False

    def _receive_bucket(self, r: int, ring: ShmRing, m: Manifest, k: int, failed: str) -> str:
        """Bucket k of TP rank r from the trainer into a free slot (into scratch once the update failed: the
        trainer's broadcast must still be received)."""
        nbytes = bucket_bytes(m.buckets[k])
        if not failed:
            try:
                slot = ring.acquire(self.seq, timeout_s=self.timeout_s,
                                    aborted=lambda: bool(self.http.error()) or not self.sidecar.server.running())
                self.group.broadcast_weights(r, ring.buffers[slot][:nbytes])
                ring.publish(self.seq)
                return ""
            except (RingAborted, RingTimeout) as e:
                failed = str(e)
        self.group.broadcast_weights(r, torch.empty(nbytes, dtype=torch.uint8))
        return failed

    def _rings(self, manifests: list[Manifest]) -> None:
        need = [max(bucket_bytes(b) for b in m.buckets) for m in manifests]
        if not self.rings or any(ring.slot_bytes < n for ring, n in zip(self.rings, need, strict=True)):
            for ring in self.rings:
                ring.close()
            self.rings = [ShmRing(self.namespace, r, slots=self.slots, slot_bytes=n, create=True)
                          for r, n in enumerate(need)]
            self.http.reinit()

    def close(self) -> None:
        self.http.close()
        if self.adapters is not None:
            self.adapters.close()
        for ring in self.rings:
            ring.close()
