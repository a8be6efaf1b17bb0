"""The sidecar rollout worker (`rollout.mode=sidecar`): vLLM server processes beside the trainer, fed by the
checkpoint engine, found in etcd.

A session (one rollout phase) runs this checklist, every rank together:

1. offload the train state (optimizer, grads) as configured (`offload.actor_*`);
2. the first rank of each TP group that owns a server (its leader): the server is healthy (else restarted
   from dummy weights) and awake (CUDA sleep mode);
3. update weights: the checkpoint engine reshards the FSDP shards into the servers' TP layout, pipelines
   them through shared memory into each of the pod's servers (and through the pod group to the other
   pods), verifies them and stamps the new version; rank 0 publishes it in etcd;
4. offload the policy params as configured (the server holds the weights now).

Leaving the session puts the server to sleep (CUDA; vLLM on CPU has no sleep mode: the server keeps its
weights and KV cache) and reloads the train state.

`generate` is data-parallel over ranks *and* servers: rank r sends the requests of samples `uid % W == r`
to the servers etcd lists at the current version (least outstanding tokens, a group's samples on one
server: `completions.Router`), many in flight, and holds exactly those samples. A failed request (a
server died, or was withdrawn) is not fatal: the ranks agree that some failed, each leader restarts its
server if it died (other pods restart their own), the current weights are pushed again,
and only the failed samples are sent again; after `sidecar.max_restarts` such rounds the run stops.
Seeds depend only on the step and the sample, so which rank or server generates a sample changes nothing.

Streaming (`submit` / `arrivals`, for asynchronous training): requests are sent on a second client and
stay in flight across sessions; the next update pauses them on the server (vLLM `keep`), and they go on
under the new weights. Each response carries the server's weight-version spans, mapped here to policy
versions per token (`Arrival.token_versions`). A session given the policy version the servers already
hold skips the update.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from hybrid_rl.data import PromptRecord
from hybrid_rl.distributed.collectives import all_gather_object, all_reduce_max
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.distributed.offload import OffloadManager, grad_tensors, optimizer_tensors, param_tensors
from hybrid_rl.model.optimizers import resident_state_to_come
from hybrid_rl.rollout.base import Arrival, RolloutError, SyncReport
from hybrid_rl.rollout.exchange import gather_index
from hybrid_rl.rollout.sampling import SamplingSettings, generation_eos, request_seed, sample_of
from hybrid_rl.rollout.speculative import SpecTally
from hybrid_rl.sidecar.agreed import on_every_rank, on_rank0
from hybrid_rl.sidecar.checkpoint_engine import PushReport
from hybrid_rl.sidecar.completions import Router
from hybrid_rl.sidecar.etcd import EtcdUnavailable
from hybrid_rl.sidecar.pod_link import GROUP_KEY
from hybrid_rl.sidecar.rollout_parts import ServerLinks, SidecarOptions, SyncedPolicy
from hybrid_rl.sidecar.server_adapter import load_on_server, read_files
from hybrid_rl.sidecar.versions import servers_at, token_versions_of
from hybrid_rl.sidecar.vllm_server import SERVED_MODEL, ServerError
from hybrid_rl.types import Request, Rollout, Sampling
from hybrid_rl.weightsync.plan import SourceParam
from hybrid_rl.weightsync.reshard import WeightSyncError

log = logging.getLogger(__name__)
T = TypeVar("T")


class SidecarRollout:
    """Rollouts from vLLM sidecar servers; weights reach them through the checkpoint engine."""

    def __init__(self, synced: SyncedPolicy, links: ServerLinks, options: SidecarOptions, *,
                 sampling: SamplingSettings, dims: ParallelDims, offload: OffloadManager, tokenizer):
        self.policy, self.optimizer, self.weights = synced.policy, synced.optimizer, synced.weights
        self.sharded, self.shard, self.dims = synced.sharded, synced.shard, dims
        self.engine, self.sidecar, self.etcd, self.client, self.stream = \
            links.engine, links.sidecar, links.etcd, links.client, links.stream
        self.offload, self.options, self.settings, self.seed = offload, options, sampling, options.seed
        self.stop_ids = tuple(sorted({tokenizer.eos_token_id} | set(generation_eos(tokenizer))))
        self.version: str | None = None  # the weight version the servers were last brought to ("v<push number>")
        self.versions = 0
        self.policy_version: int | None = None  # the policy version of those weights (None: not said)
        self.policy_of: dict[str, int] = {}  # weight version -> policy version, for the tokens' spans
        self._report = SyncReport()
        self._active = False
        self._sized = False  # the in-flight cap follows the servers' KV capacity (read once they are up)
        self.router = Router()
        self.private_etcd = links.private_etcd  # rank 0 of a one-pod run given no sidecar.etcd: stopped at close
        # Every key is under the run's prefix and every weight version is "<run id>-v<n>": a server of another run
        # (same output folder name, same etcd) is never listed at our version, and tokens it sampled are refused.
        self.run_id = links.run_id
        self.announcement = links.announcement  # rank 0: the run announced to rollout-only pods (closed at close)
        # `model.lora.sync=adapter`: `weights` are the frozen base (pushed where a server lacks it), and each update
        # is the adapter alone, loaded under the update's version label, which requests name as their model.
        self.adapter, self.adapter_timeout_s = synced.adapter, options.adapter_timeout_s
        # Optimizers whose state stays on the trainer's GPUs during rollouts unless offloaded: a server started on
        # them (CUDA, automatic share) leaves room for the state they have yet to create (`state_to_come`).
        self._resident = [(self.optimizer, options.offload_optim)] if self.optimizer is not None else []
        if links.sidecar is not None:
            links.sidecar.state_to_come = self.state_to_come

    def keep_room_for(self, optimizer: torch.optim.Optimizer, offload: str) -> None:
        self._resident.append((optimizer, offload))

    def state_to_come(self) -> int:
        """Device memory this rank's optimizers will hold at every later rollout but do not hold yet (the ranks of
        a server's TP group hold shards of the same size)."""
        device = next(self.policy.parameters()).device
        return resident_state_to_come(self._resident, device)

    # -- the session -----------------------------------------------------------------------------

    @contextmanager
    def session(self, version: int | None = None) -> Iterator[SidecarRollout]:
        t0 = time.perf_counter()
        o = self.options
        self._offload("actor.optim", optimizer_tensors(self.optimizer) if self.optimizer else [], o.offload_optim)
        self._offload("actor.grads", grad_tensors(self.policy), o.offload_grads)
        try:
            self._leaders("starting the pod's vLLM servers", self._wake)
            self._size_inflight()
            seconds, nbytes = 0.0, 0
            if version is None or version != self.policy_version or \
                    not all(self._leaders("checking the servers", self._holds)):
                self.versions += 1
                self.policy_version = version if version is not None else self.policy_version
                label = f"{self.run_id}-v{self.versions}" if self.run_id else f"v{self.versions}"
                self.policy_of[label] = -1 if self.policy_version is None else self.policy_version
                push = self._push_recovering(label)
                seconds, nbytes = push.seconds, push.bytes_written
            self._offload("actor.params", param_tensors(self.policy), o.offload_params)
            self._report = SyncReport(seconds, time.perf_counter() - t0 - seconds, nbytes)
            self._active = True
            yield self
        finally:
            self._active = False
            if self.sidecar is not None and o.sleep and self.sidecar.server.healthy():
                self.sidecar.sleep(o.sleep_level)  # each leader its own server
            for name in ("actor.params", "actor.grads", "actor.optim"):
                self.offload.reload(name)

    def _offload(self, name: str, tensors: list[torch.Tensor], target: str) -> None:
        self.offload.offload(name, tensors, target)

    def _holds(self) -> bool:
        """A leader: its server is up and holds the weights last pushed (other ranks: True). Called after `_wake`, which
        waited for `/health`: a process still running is enough here (one slow health check costs no update)."""
        return self.sidecar is None or (self.sidecar.server.running() and self.sidecar.version == self.version)

    def _withdraw(self) -> None:
        """A leader whose server was in the failed update: out of dispatch (servers left out of it keep serving)."""
        if self.sidecar is not None and self.engine.feeds:
            self.sidecar.withdraw()

    def _stale(self) -> frozenset[int]:
        """Every rank: the pod's servers (numbers as `CheckpointEngine.server_of`) that do not hold the weights last
        pushed."""
        states = self._leaders("checking the servers", lambda: None if self.sidecar is None else
                               (self.engine.server_index, self._holds()))
        return frozenset(index for state in states if state is not None for index, holds in [state] if not holds)

    def _size_inflight(self) -> None:
        """Once, the servers up: unless `sidecar.max_inflight` is set, the rank's requests in flight are what the
        run's servers hold at once (each: its KV cache's tokens over one request's, at most `max_num_seqs`; other
        pods' servers counted as this pod's), shared out over the ranks."""
        if self._sized:
            return
        self._sized = True
        o = self.options
        caps = [c for c in self._leaders("reading the servers' KV capacity", self._kv_capacity) if c]
        if o.max_inflight or not caps:
            return
        at_once = [min(o.max_num_seqs, max(1, c // o.request_tokens)) for c in caps]
        n = max(1, math.ceil(sum(at_once) * o.servers / len(at_once) / self.dims.world))
        self.client.resize(n)
        self.stream.resize(n)
        if self.dims.rank == 0:
            log.info("vLLM servers' KV caches hold %s tokens: %s requests of %d tokens at once (sidecar.max_num_seqs="
                     "%d); %d requests in flight per rank", caps, at_once, o.request_tokens, o.max_num_seqs, n)

    def _kv_capacity(self) -> int | None:
        return self.sidecar.server.kv_capacity_tokens() if self.sidecar is not None else None

    def _wake(self) -> None:
        if self.sidecar is not None:
            self.sidecar.ensure_running()
            if self.options.sleep:
                self.sidecar.wake_up()

    def _push_recovering(self, version: str, only: frozenset[int] | None = None):
        """`_push`, again after restarting the server when it failed during the update (every rank alike). `only`:
        the pod's servers to update (a retry then updates those that still lack the weights)."""
        for attempt in range(self.options.max_restarts + 1):
            try:
                return self._push(version, only)
            except WeightSyncError:
                self._leaders("withdrawing the servers of the failed update", self._withdraw)
                raise
            except ServerError as e:
                # The servers of a failed update hold partly new weights under the old label, paused: out of dispatch
                # until a full verified update lands.
                self._leaders("withdrawing the servers of the failed update", self._withdraw)
                if attempt == self.options.max_restarts:
                    raise RolloutError(f"weight update {version} failed {attempt + 1} times: {e}") from None
                log.warning("weight update %s failed (%s); restarting the server and updating again", version, e)
                self._leaders("restarting the pod's vLLM servers", self._wake)
                if only is not None:
                    only = self._stale()

    def _push(self, version: str, only: frozenset[int] | None = None):
        """Every rank: the checkpoint engine's update (with an adapter: the base, only where a server lacks it, then
        the adapter); the leaders then mark their servers and rank 0 publishes the version. `only`: the pod's
        servers whose base to update (None: all)."""
        rep = PushReport(version)
        if self.adapter is None or not self._base_everywhere():
            sources = [SourceParam(name, local, shape) for name, local, shape in self.weights.weights()
                       if not self.engine.layout.skip(name)]
            rep = self.engine.push(sources, version, sharded=self.sharded, shard=self.shard, only=only)
        if self.adapter is not None:
            rep = self._push_adapter(version, rep)
        self._leaders("publishing the weight version in etcd", lambda: self._publish(version))
        self.version = version
        return rep

    def _base_everywhere(self) -> bool:
        """Every server of the run holds the base weights: each is at the version last pushed (one restarted, found
        dead or failed is at none; a busy server slow to answer `/health` still holds them)."""
        if self.version is None:
            return False
        here = all(self._leaders("checking the servers", lambda: self.sidecar is None or
                                 self.sidecar.version == self.version))
        everywhere = here and self._rank0("listing the servers in etcd", self._all_current)
        if not everywhere and self.dims.rank == 0:
            log.info("sending the base weights again with update %s: some server no longer holds %s",
                     self.versions, self.version)
        return everywhere

    def _push_adapter(self, version: str, rep: PushReport) -> PushReport:
        """Every rank gathers the adapter; each leader loads it into its server, rank 0 sends it to the other pods.
        ServerError on every rank when a server refused it (the server is withdrawn and gets the base again)."""
        t0 = time.perf_counter()
        path, nbytes = self.adapter.write(version, writes=self.sidecar is not None)
        error = ""
        if self.sidecar is not None:
            try:
                load_on_server(self.sidecar.server, self.adapter.folders, version, timeout_s=self.adapter_timeout_s)
            except (ServerError, WeightSyncError, OSError) as e:
                error = f"rank {self.dims.rank}: {e}"
        if errors := [e for e in all_gather_object(error) if e]:
            raise ServerError(f"adapter {version} did not load: {errors[0]}")
        if self.engine.link is not None:
            self.engine.link.adapter(version, read_files(path) if self.dims.rank == 0 else None, self.dims.rank)
        rep.phases["adapter_s"] = time.perf_counter() - t0
        rep.seconds += rep.phases["adapter_s"]
        rep.bytes_written += nbytes if self.sidecar is not None else 0
        return rep

    def model_name(self) -> str:
        """What requests name: the served base, or the adapter version the servers were last brought to."""
        return self.version if self.adapter is not None and self.version is not None else SERVED_MODEL

    def _publish(self, version: str) -> None:
        if self.sidecar is not None:
            self.sidecar.loaded(version)
        if self.dims.rank == 0:
            self.etcd.put("version", {"version": version, "update": self.engine.updates - 1})

    def _rank0(self, what: str, fn: Callable[[], T]) -> T:
        return on_rank0(self.dims.rank, what, fn)

    def _leaders(self, what: str, fn: Callable[[], T]) -> list[T]:
        return on_every_rank(self.dims.rank, what, fn)

    def last_sync(self) -> SyncReport:
        return self._report

    # -- generation ------------------------------------------------------------------------------

    def generate(self, records: list[PromptRecord], *, n: int, step: int, group_base: int,
                 greedy: bool = False) -> Rollout:
        """Rank r generates (and holds) the samples `uid % world == r`. Collective, inside a session."""
        if not self._active:
            raise RuntimeError("SidecarRollout.generate() needs a session: use `with rollout.session():`")
        d, sampling = self.dims, self._sampling(greedy)
        total = len(records) * n
        todo = [Request(u, list(records[u // n].prompt_ids), request_seed(self.seed, step, group_base + u // n) + u % n,
                        affinity=group_base + u // n) for u in range(d.rank, total, d.world)]
        done = {}
        for attempt in range(self.options.max_restarts + 1):
            results, failed = self.client.run(todo, sampling, self._router(), self.model_name())
            for key, g in results.items():
                if unknown := [v for v, _, _ in g.weight_spans if v not in self.policy_of]:
                    failed[key] = f"tokens sampled under weight version {unknown[0]!r}, which this run did not push"
                else:
                    done[key] = g
            if not all_reduce_max([float(len(failed))])[0]:
                break
            if attempt == self.options.max_restarts:
                raise RolloutError(f"generation failed after {attempt} server restarts; last errors on rank "
                                    f"{d.rank}: {list(failed.values())[:3]}")
            if failed:
                log.warning("rank %d: %d of %d requests failed (%s); recovering the servers", d.rank, len(failed),
                            len(todo), next(iter(failed.values())))
            self._recover()
            todo = [r for r in todo if r.key in failed]
        held = [sample_of(u, records[u // n], done[u], group_base + u // n,
                          token_versions=token_versions_of(done[u], self.policy_of)) for u in sorted(done)]
        metrics = {}
        if self.settings.speculative:
            tally = SpecTally()
            tally.add(done.values())
            metrics = tally.metrics()
        return Rollout(held, gather_index(held, total), metrics)

    def _sampling(self, greedy: bool) -> Sampling:
        s = self.settings
        return Sampling(max_tokens=s.max_new_tokens, temperature=0.0 if greedy else s.temperature,
                        top_p=1.0 if greedy else s.top_p, top_k=-1 if greedy else s.top_k, n=1,
                        stop_token_ids=self.stop_ids)

    # -- streaming (asynchronous training) -------------------------------------------------------

    def submit(self, requests: list[Request], *, greedy: bool = False) -> None:
        """Send this rank's requests and return at once. Collective (the servers are listed on rank 0)."""
        if not self._active:
            raise RuntimeError("SidecarRollout.submit() needs a session: use `with rollout.session():`")
        self.stream.submit(requests, self._sampling(greedy), self._router(), self.model_name())

    def arrivals(self) -> tuple[dict[int, Arrival], dict[int, str]]:
        """This rank's streamed requests that ended since the last call: responses with the policy version of
        each token, and errors (a response sampled under a weight version this worker never pushed is one)."""
        done, failed = self.stream.drain()
        out = {}
        for key, g in done.items():
            unknown = [v for v, _, _ in g.weight_spans if v not in self.policy_of]
            if unknown:
                failed[key] = f"tokens sampled under weight version {unknown[0]!r}, which this trainer did not push"
                continue
            out[key] = Arrival(g, token_versions_of(g, self.policy_of))
        return out, failed

    def in_flight(self) -> int:
        return self.stream.in_flight

    def recover(self) -> None:
        """Every rank: the servers back (restarted if they died) at the current weights."""
        self._recover()

    def _router(self) -> Router:
        """The servers etcd lists at the current version (the same list on every rank; none: every request fails
        and the ranks recover)."""
        self.router.set_servers(self._rank0("listing the servers in etcd", self._current_servers))
        return self.router

    def _current_servers(self) -> list[str]:
        return servers_at(self.etcd, self.version)

    def _recover(self) -> None:
        """Every rank: restart this pod's servers that died; then push the current weights to this pod's servers
        that lack them (restarted, or withdrawn), and only to those; when another pod's server lacks them, the
        broadcast goes to every other pod (it is one collective, fed by server 0's writers). Failed requests on
        healthy servers at the current version cost no update."""
        self._leaders("restarting the pod's vLLM servers", self._wake)
        stale = self._stale()
        if not stale and self._rank0("listing the servers in etcd", self._all_current):
            log.info("every server holds weights %s: resending the failed requests without an update", self.version)
            return
        if self.dims.rank == 0:
            log.info("weights %s pushed again to the pod's servers %s%s", self.version, sorted(stale) or "(none)",
                     " and the other pods" if self.engine.link is not None else "")
        self.offload.reload("actor.params")
        self._push_recovering(self.version, only=stale if stale or self.engine.link is not None else None)
        self._offload("actor.params", param_tensors(self.policy), self.options.offload_params)

    def _all_current(self) -> bool:
        rows = self.etcd.get_prefix("servers")
        return bool(rows) and all(v.get("version") == self.version for v in rows.values())

    def close(self) -> None:
        self.client.close()
        self.stream.close()
        self.engine.close()
        if self.adapter is not None:
            self.adapter.close()
        if self.sidecar is not None:
            self.sidecar.close()
        if self.dims.rank == 0:
            try:
                self.etcd.delete("version")
                self.etcd.delete(GROUP_KEY)
            except EtcdUnavailable as e:  # stopping because etcd is gone: nothing to clean there
                log.warning("%s", e)
        if self.announcement is not None:
            self.announcement.close()
        if self.private_etcd is not None:  # (another leader's lease revoke then fails at once: nothing to wait for)
            self.private_etcd.stop()
            shutil.rmtree(self.private_etcd.data_dir, ignore_errors=True)
            self.private_etcd.data_dir.with_suffix(".log").unlink(missing_ok=True)
