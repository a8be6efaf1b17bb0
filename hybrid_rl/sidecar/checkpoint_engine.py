"""The trainer's side of the checkpoint engine: FSDP shards -> the server's TP layout -> shared memory -> vLLM.

One update ("register shard", then "update weight"), on every trainer rank in lockstep:

1. The colocated resharding plan (`weightsync/plan.build_plan`) with the *servers'* TP layout: a node runs
   `servers` servers, server g fed by the node's ranks g*tp .. g*tp+tp-1 (rank r writes TP slice r % tp
   of its server: its "writer"; the first of them, the server's leader, drives it over HTTP); ranks
   beyond them only send their FSDP rows. Cached per set of weights.
2. Each writer keeps a ring of shared-memory slots (`shm_ring.py`) beside a manifest of the update (which
   slices each bucket holds). Bucket k's pieces are assembled straight into a free slot (one copy, cast
   to the rollout dtype), then published; meanwhile the leader has already asked the server (over HTTP, in
   order, from one background thread) to load bucket k, and goes on with bucket k+1: the trainer fills
   the next slot while the server loads the previous one, and no more than `slots` buckets are ever in
   shared memory.
3. `PodLink` (optional) sends each slot of server 0's writers on to the receivers of other pods
   (`sidecar/pod_group.py`), and tells them when an update is abandoned mid-way.
4. Each leader finishes the update; every writer compares the server's checksums of what landed (its
   report) with the senders' (`plan.expected`), exactly as colocated verification does; only when every
   rank agrees does each leader stamp the version (`/update_weight_version`) and read it back.

Generation is paused (vLLM's `keep` mode) from the start of the update until after the stamp: requests in
flight wait, then continue under the new weights (their KV recomputed, as the prefix cache's is dropped),
each token stamped with the version that sampled it (`server_update.py`); after a failed update they are
aborted instead and the server stays paused (its owner withdraws it from dispatch) until an update lands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybrid_rl.distributed.collectives import all_gather_object, all_reduce, barrier
from hybrid_rl.sidecar.server_update import ServerUpdate
from hybrid_rl.sidecar.shm_ring import (
    Entry,
    Manifest,
    RingAborted,
    RingTimeout,
    ShmRing,
    ShmSpaceError,
    abort_path,
    bucket_bytes,
    layout_bucket,
    write_manifest,
)
from hybrid_rl.sidecar.vllm_server import ServerError, VLLMServer
from hybrid_rl.weightsync.layout import Layout, TPSlice
from hybrid_rl.weightsync.plan import ReshardPlan, SourceParam, build_plan
from hybrid_rl.weightsync.reshard import WeightSyncError, stream_buckets
from hybrid_rl.weightsync.verify import checksums_match, target_label, verify_targets

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushOptions:
    bucket_bytes: int
    slots: int  # shared-memory slots per TP rank: buckets in flight
    probe_cols: int
    timeout_s: float  # how long either side waits for the other before the update fails


@dataclass
class PushReport:
    """What one update cost and moved."""

    version: str = ""
    seconds: float = 0.0
    bytes_written: int = 0  # by this rank into shared memory
    buckets: int = 0
    wait_s: float = 0.0  # this rank's time waiting for a free slot (the server loading)
    phases: dict[str, float] = field(default_factory=dict)


class PodLink(Protocol):
    """Where a writer's published buckets also go: the receivers of other pods."""

    def begin(self, update: int, version: str, manifest: Manifest, rank: int) -> None: ...

    def send(self, tp_rank: int, k: int, data: torch.Tensor) -> None: ...

    def abort(self, rank: int, why: str) -> None: ...

    def end(self, expected: torch.Tensor, rank: int) -> None: ...

    def close(self, rank: int) -> None: ...


@dataclass(frozen=True)
class RankPlace:
    """Where this trainer rank sits: its rank, the world, its node's ranks, and the servers per node."""

    rank: int
    world: int
    servers: int = 1  # per node: server g of a node is fed by its local ranks g*tp .. g*tp+tp-1
    local_world: int | None = None  # None: one node


@dataclass(frozen=True)
class PushTarget:
    """Where and how the weights go: the servers' TP layout, their shared-memory namespace, the device and dtype the
    slices are made on and in, the server this rank drives (a leader), and the other pods (the pod group)."""

    layout: Layout
    namespace: str
    device: torch.device
    dtype: torch.dtype
    server: Callable[[], VLLMServer] | None = None  # looked up at each push: it may restart
    link: PodLink | None = None


class CheckpointEngine:
    """Pushes the policy's weights into one pod's vLLM server (and through `link`, other pods')."""

    def __init__(self, place: RankPlace, target: PushTarget, options: PushOptions):
        rank, world, servers, layout = place.rank, place.world, place.servers, target.layout
        self.rank, self.world, self.layout, self.namespace = rank, world, layout, target.namespace
        self.options, self.device, self.dtype, self.link = options, target.device, target.dtype, target.link
        self.server = target.server  # a server's leader: the server it feeds (looked up at each push: it may restart)
        self.tp = layout.tp
        self.local_world = place.local_world or world
        if self.local_world < self.tp * servers:
            raise ValueError(f"{servers} vLLM sidecar(s) at TP {self.tp} need {self.tp * servers} trainer ranks, the "
                             f"node has {self.local_world}: each server TP rank needs one trainer rank to write its "
                             "slices")
        # `servers` per node: server g of a node is fed by its local ranks g*tp .. g*tp+tp-1 (rank r writes TP slice
        # r % tp into the ring of its server's namespace; the first, its leader, drives it over HTTP). Ranks beyond
        # the servers' only send their FSDP rows.
        self.servers = servers
        self.writer = self._writes(rank)
        self.tp_rank = rank % self.tp
        self.leader = self.writer and self.tp_rank == 0
        self.server_index = self.server_of(rank)  # the server this rank writes to (writers only)
        self.feeds = self.writer  # this rank writes to its server in the update in progress
        self.pushes = 0  # updates this rank's server was sent (a leader's count)
        self._plans: dict[tuple[str, ...], tuple[ReshardPlan, list[list[Entry]]]] = {}
        self.ring: ShmRing | None = None
        self.seq = 0  # buckets written over the ring's life
        self.updates = 0
        self.http = ServerUpdate(self.namespace, timeout_s=options.timeout_s) if self.leader else None
        self._failed = ""  # this rank's reason the update in progress failed
        self._link_open = False  # other pods are receiving an update that has not ended

    # -- one update ------------------------------------------------------------------------------

    def push(self, sources: list[SourceParam], version: str, *, sharded: bool, shard: int = 0,
             only: frozenset[int] | None = None) -> PushReport:
        """Bring the servers to `version`: every rank calls it with its shards, and every rank raises the same
        error when it fails: ServerError (the server failed or died; nothing is stamped) or WeightSyncError
        (the server's weights do not match what was sent; the version is not stamped). `only`: the pod's servers
        (numbers as `server_of`) to update, the others keep what they hold and are not touched (a recovery after
        some restarted); with other pods, server 0 is always among them (its writers feed the pod group)."""
        if only is not None and self.link is not None:
            only = only | {0}
        self.feeds = self.writer and (only is None or self.server_index in only)
        ok = False
        try:
            rep = self._push(sources, version, sharded=sharded, shard=shard)
            ok = True
            return rep
        except Exception as e:
            if self._link_open:  # the other pods' receivers wait for the rest of it: tell them it is abandoned
                self._link_open = False
                self.link.abort(self.rank, f"{type(e).__name__}: {e}")
            raise
        finally:
            if self._drives and (error := self.http.end(ok=ok)):
                log.warning("server %s after update %s (resuming generation): %s", self.http.server.url, version, error)

    def _push(self, sources: list[SourceParam], version: str, *, sharded: bool, shard: int = 0) -> PushReport:
        t0 = time.perf_counter()
        rep = PushReport(version)
        plan, buckets = self._plan(sources, sharded, shard)
        update = self.updates
        self._failed = ""
        manifest = Manifest(update, self.options.probe_cols, buckets, tied=self.layout.dims.tie_word_embeddings)
        error = ""
        if self.feeds:
            try:
                self._ring(buckets).reset()
                write_manifest(self.ring, manifest)
            except (ShmSpaceError, RuntimeError) as e:  # no room in /dev/shm, pinning refused: every rank stops
                error = str(e)
        if bool(all_reduce(torch.tensor([float(bool(error))]), "max")[0]):
            raise ShmSpaceError(next(e for e in all_gather_object(error) if e))
        if self._drives:
            abort_path(self.namespace).unlink(missing_ok=True)
        if self.link is not None:
            self.link.begin(update, version, manifest, self.rank)
            self._link_open = True
        barrier()  # every writer's manifest is in place before the server reads them
        if self._drives:
            self.http.begin(self.server())
            self.pushes += 1
        for k, items in stream_buckets(plan, sources, device=self.device, probe_cols=self.options.probe_cols,
                                       sync_index=update, alloc=self._alloc(rep)):
            if self.feeds and not self._failed:
                self.ring.publish(self.seq)
                rep.bytes_written += sum(t.numel() * t.element_size() for _, t in items)
            if self.link is not None and self.rank < self.tp:  # other pods get server 0's slices (stale once failed)
                self.link.send(self.rank, k, self.ring.buffers[self.ring.slot_of(self.seq)][:bucket_bytes(buckets[k])])
            if self._drives and not self._failed:
                self.http.bucket(self.seq, k)
            rep.buckets += 1
            self._agree()  # a failure on any rank stops every rank at the same bucket
        rep.phases["stream_s"] = time.perf_counter() - t0
        if self._drives:
            self._failed = self._failed or self.http.finish()
        self._agree()
        targets = verify_targets(plan.slices, tied=manifest.tied)
        expected = plan.expected.cpu()[[i for i, _ in targets]]  # the senders' checksum of each target
        ok = all_reduce(self._verified(expected), "min").bool()  # one verdict on every rank
        if self.link is not None:
            self._link_open = False
            self.link.end(expected, self.rank)
        if not bool(ok.all()):
            bad = [target_label(plan.slices, *targets[j]) for j in torch.nonzero(~ok).flatten().tolist()]
            raise WeightSyncError(f"weight update {update} (version {version}) did not land in vLLM as sent "
                                  f"({len(bad)} mismatched: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}); "
                                  "the server keeps its previous version stamp")
        if self._drives:
            try:
                self.http.stamp(version)
            except (ServerError, WeightSyncError) as e:
                self._failed = str(e)
        self._agree()
        self.updates += 1
        rep.seconds = time.perf_counter() - t0
        return rep

    def _writes(self, rank: int) -> bool:
        return rank % self.local_world < self.tp * self.servers

    def server_of(self, rank: int) -> int:
        """The pod's number of the server `rank` writes to (node-major: a node's servers, then the next node's)."""
        return (rank // self.local_world) * self.servers + (rank % self.local_world) // self.tp

    @property
    def _drives(self) -> bool:
        """This rank drives its server through the update in progress (its leader, when it is being updated)."""
        return self.leader and self.feeds

    def _agree(self) -> None:
        """Every rank learns whether any rank failed; all raise the same ServerError if so."""
        if self._drives:
            self._failed = self._failed or self.http.error()
            if self._failed:
                abort_path(self.namespace).touch()  # writers waiting on the server stop waiting
        if bool(all_reduce(torch.tensor([float(bool(self._failed))]), "max")[0]):
            raise ServerError(f"weight update {self.updates} abandoned: a vLLM server failed"
                              f"{' (' + self._failed + ')' if self._failed else ' (see the first rank of its TP group)'}")

    def _plan(self, sources: list[SourceParam], sharded: bool, shard: int = 0) -> tuple[ReshardPlan, list[list[Entry]]]:
        key = tuple(s.name for s in sources)
        if key not in self._plans:
            plan = build_plan(sources, self.layout, rank=self.rank, world=self.world,
                              tp_rank_of=lambda r: r % self.tp, receives=self._writes,
                              bucket_bytes=self.options.bucket_bytes, dtype=self.dtype, sharded=sharded,
                              shard=shard or None)
            buckets = [layout_bucket([plan.slices[i] for i in b.indices], self.dtype)[0] for b in plan.buckets]
            self._plans[key] = plan, buckets
        return self._plans[key]

    def _ring(self, buckets: list[list[Entry]]) -> ShmRing:
        need = max((bucket_bytes(b) for b in buckets), default=0)
        if self.ring is None or self.ring.slot_bytes < need:
            if self.ring is not None:
                self.ring.close()
            self.ring = ShmRing(self.namespace, self.tp_rank, slots=self.options.slots, slot_bytes=need, create=True,
                                pin=self.device.type == "cuda")
            if self.http is not None:
                self.http.reinit()  # the server must map the new files
        return self.ring

    def _alloc(self, rep: PushReport):
        """Bucket k's slices are assembled straight into the next free slot of this writer's ring (into scratch
        tensors once the update failed: the stream still runs to the end of the bucket on every rank)."""
        abort = abort_path(self.namespace)

        def aborted() -> bool:
            return abort.exists() or (self._drives and bool(self.http.error()))

        def alloc(k: int, slices: list[TPSlice]) -> list[torch.Tensor]:
            if self.feeds and not self._failed:
                self.seq += 1
                t = time.perf_counter()
                try:
                    slot = self.ring.acquire(self.seq, timeout_s=self.options.timeout_s, aborted=aborted)
                    rep.wait_s += time.perf_counter() - t
                    return self.ring.views(slot, layout_bucket(slices, self.dtype)[0])
                except (RingAborted, RingTimeout) as e:
                    self._failed = str(e)
            return [torch.empty(ts.shape, dtype=self.dtype, device=self.device) for ts in slices]
        return alloc

    def _verified(self, expected: torch.Tensor) -> torch.Tensor:
        """Per verification target, 1.0 where the server's checksum of what its forward reads matches the senders'
        (1.0 everywhere on ranks that write nothing; 0.0 everywhere when the report is not of these targets)."""
        ok = torch.ones(len(expected))
        if not self.feeds:
            return ok
        got = self.ring.read_report(self.updates)
        if got.numel() != len(expected):
            log.error("rank %d: the vLLM server reported %d checksums, %d expected", self.rank, got.numel(),
                      len(expected))
            return ok * 0
        return checksums_match(expected, got).to(torch.float32)

    def close(self) -> None:
        if self.link is not None:
            self.link.close(self.rank)
        if self.http is not None:
            self.http.close()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
