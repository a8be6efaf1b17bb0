"""HybridEngine: the same ranks hold the policy as FSDP2 shards (train mode) and as vLLM (rollout mode).

Who owns which memory in which mode:

=================  ===========================================  ==================================================
                   train mode                                   rollout mode
=================  ===========================================  ==================================================
policy params      FSDP2 shards, resident                       offloaded after the sync (`offload.actor_params`)
grads, optimizer   resident (grads only inside an update)       offloaded first (`offload.actor_grads/optim`)
vLLM weights       released (`release`: sleep / restart)        resident, synced from the shards
KV cache           released                                     resident
=================  ===========================================  ==================================================

The switch into rollout runs a fixed checklist, one logged line per step with time and memory:
offload train state (grads, optimizer) -> bring vLLM weights in -> sync (bucketed reshard + verify)
-> offload the policy params (they were the sync's source; sharded, they are 1/W of the model)
-> bring the KV cache in. Leaving rollout releases the KV cache and vLLM weights, then reloads the
train state. `generate()` outside rollout mode is an error, not a silent slow path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

import torch

from hybrid_rl.colocated.engine_parts import SwitchOptions, SyncTarget, TrainedPolicy
from hybrid_rl.distributed.collectives import all_gather_object
from hybrid_rl.distributed.fsdp import is_sharded, shard_size
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.distributed.offload import (
    OffloadManager,
    grad_tensors,
    optimizer_tensors,
    param_tensors,
)
from hybrid_rl.distributed.shm_exchange import ShmExchange
from hybrid_rl.model.optimizers import resident_state_to_come
from hybrid_rl.types import Generation, Sampling
from hybrid_rl.utils import memory
from hybrid_rl.weightsync.grouped import slice_digest
from hybrid_rl.weightsync.plan import ReshardPlan, SourceParam, build_plan
from hybrid_rl.weightsync.reshard import SyncStats, WeightSyncError, shared_exchange, stream_buckets
from hybrid_rl.weightsync.source import ModuleWeights
from hybrid_rl.weightsync.verify import checksums_match, probe_for, target_label, verify_targets
from hybrid_rl.weightsync.vllm_weights import ROW_PATHS

log = logging.getLogger(__name__)

RELEASE_MODES = ("keep", "sleep", "restart")


class Mode(Enum):
    TRAIN = "train"
    ROLLOUT = "rollout"


@dataclass
class SwitchReport:
    """What the last switch into rollout did: for metrics and the log."""

    seconds: dict[str, float] = field(default_factory=dict)
    sync_path: str = ""
    transport: str = ""  # how buckets moved between ranks: none (each rank its own), shared_memory or all_to_all
    bytes_received: int = 0
    buckets: int = 0
    peak_buffer_bytes: int = 0


class HybridEngine:
    """Owns the switch between FSDP training and vLLM rollout on this rank."""

    def __init__(self, policy: TrainedPolicy, target: SyncTarget, *, dims: ParallelDims, offload: OffloadManager,
                 options: SwitchOptions):
        self.policy, self.optimizer, self.dims = policy.module, policy.optimizer, dims
        self.vllm, self.layout, self.offload, self.options = target.vllm, target.layout, offload, options
        self.device, self.sync_dtype = target.device, target.dtype
        self.mode = Mode.TRAIN
        self.report = SwitchReport()
        self.sync_index = 0
        self.weights = policy.weights or ModuleWeights(policy.module)
        self.adapter = policy.adapter  # `model.lora.sync=adapter`: the adapter goes to vLLM by itself after each sync
        self._plans: dict[tuple[str, ...], ReshardPlan] = {}
        self._exchanges: dict[tuple[str, ...], ShmExchange | None] = {}
        self._path: str | None = None
        self._vllm_current = False  # vLLM holds the weights of the last sync (so only changes need sending)
        self._verbose = True  # log the first round trip's checklist at INFO
        # Optimizers whose state is on the device during rollouts, with where it goes for them (`offload.*`):
        # the actor's, and the critic's once built (`keep_room_for`).
        self._resident: list[tuple[torch.optim.Optimizer, str]] = []
        if self.optimizer is not None:
            self._resident.append((self.optimizer, options.offload_optim))

    def keep_room_for(self, optimizer: torch.optim.Optimizer, offload: str) -> None:
        """Another optimizer whose state stays on the device through rollouts unless `offload` moves it (the
        critic's, `offload.critic`): vLLM's automatic share leaves room for the state it has yet to create."""
        self._resident.append((optimizer, offload))

    # -- modes -----------------------------------------------------------------------------------

    @contextmanager
    def rollout_mode(self) -> Iterator[HybridEngine]:
        """Enter rollout mode for the body of the `with`, then return to train mode."""
        self.enter_rollout()
        try:
            yield self
        finally:
            self.enter_train()

    def enter_rollout(self) -> None:
        assert self.mode is Mode.TRAIN, "enter_rollout() called in rollout mode"
        try:
            self._switch_to_rollout()
        except BaseException:
            # Leave the engine usable in train mode: nothing stays offloaded behind an error.
            self._reload_train_state()
            raise
        self.mode = Mode.ROLLOUT

    def _switch_to_rollout(self) -> None:
        o, rep = self.options, SwitchReport()
        with self._step(rep, "offload_train_state"):
            if self.optimizer is not None:
                self.offload.offload("actor.optim", optimizer_tensors(self.optimizer), o.offload_optim)
            self.offload.offload("actor.grads", grad_tensors(self.policy), o.offload_grads)
        with self._step(rep, "vllm_weights_in"):
            if not self.vllm.started:
                self.vllm.start(pending_bytes=self._state_to_come())
                self._vllm_current = False
            elif o.release == "sleep":
                self.vllm.wake_up(["weights"])
        with self._step(rep, "sync_weights"):
            self._sync(rep)
        if self.adapter is not None:
            with self._step(rep, "sync_adapter"):
                rep.bytes_received += self.adapter.publish(self.vllm)
        with self._step(rep, "offload_params"):
            self.offload.offload("actor.params", param_tensors(self.policy), o.offload_params)
        with self._step(rep, "kv_cache_in"):
            if o.release == "sleep":
                self.vllm.wake_up(["kv_cache"])
        self.report = rep

    def enter_train(self) -> None:
        assert self.mode is Mode.ROLLOUT, "enter_train() called in train mode"
        rep = self.report
        with self._step(rep, "release_vllm"):
            if self.options.release == "sleep":
                # Level 1 keeps the weights (in host memory) when only some will change: LoRA sends just those.
                keep = self.weights.changed_names() is not None
                self.vllm.sleep(level=1 if keep else 2)
                self._vllm_current = keep
            elif self.options.release == "restart":
                self.vllm.stop()
        with self._step(rep, "reload_train_state"):
            self._reload_train_state()
        self.mode = Mode.TRAIN
        self._verbose = False

    def _state_to_come(self) -> int:
        """Device memory the trainer does not hold yet but will at every later rollout: the state of each resident
        optimizer (the actor's, the critic's) before its first step, unless its `offload.*` moves it off the
        device for rollouts."""
        return resident_state_to_come(self._resident, self.device)

    def _reload_train_state(self) -> None:
        for name in ("actor.params", "actor.grads", "actor.optim"):
            self.offload.reload(name)

    def close(self) -> None:
        """Shut vLLM down (before the process group goes) and drop offload files."""
        if self.mode is Mode.ROLLOUT:
            self.enter_train()
        self.vllm.stop()
        self.offload.close()
        self._exchanges.clear()  # unmaps the sync's shared memory once no view of it is left
        if self.adapter is not None:
            self.adapter.close()

    @contextmanager
    def _step(self, rep: SwitchReport, name: str) -> Iterator[None]:
        before = memory.describe()
        t0 = time.perf_counter()
        yield
        rep.seconds[name] = time.perf_counter() - t0
        if self.dims.is_main:  # the whole checklist at the first switch; afterwards only with DEBUG logging
            level = logging.INFO if self._verbose else logging.DEBUG
            log.log(level, "switch %-20s %7.3fs  %s -> %s", name, rep.seconds[name], before, memory.describe())

    # -- rollout ---------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int],
                 max_tokens: list[int] | None = None) -> list[list[Generation]]:
        if self.mode is not Mode.ROLLOUT:
            raise RuntimeError("HybridEngine.generate() needs rollout mode: use `with engine.rollout_mode():`")
        return self.vllm.generate(prompts, sampling, seeds, max_tokens)

    def turns(self, sampling: Sampling, tally=None):
        """The engine driven request by request (the multi-turn loop's per-trajectory schedule); rollout mode.
        `tally` (a `SpecTally`) counts each finished turn's drafted and accepted tokens."""
        if self.mode is not Mode.ROLLOUT:
            raise RuntimeError("HybridEngine.turns() needs rollout mode: use `with engine.rollout_mode():`")
        return self.vllm.turns(sampling, tally)

    # -- weight sync -----------------------------------------------------------------------------

    def _sources(self) -> list[SourceParam]:
        """The weights to send: all of them, or only the vLLM modules that can have changed since last time."""
        changed = self.weights.changed_names() if self._vllm_current else None
        modules = None if changed is None else {self.layout.rule_for(n)[1].rsplit(".", 1)[0] for n in changed}
        out = []
        for name, local, shape in self.weights.weights():
            if self.layout.skip(name):
                continue
            # Whole fused modules go together: vLLM processes qkv / gate_up only when all parts arrive.
            if modules is None or self.layout.rule_for(name)[1].rsplit(".", 1)[0] in modules:
                out.append(SourceParam(name, local, shape))
        return out

    def _sync(self, rep: SwitchReport) -> None:
        sources = self._sources()
        if not sources:  # vLLM holds every weight that can change (LoRA adapter sync: the base, sent once)
            rep.sync_path = self._path or ""
            return
        key = tuple(s.name for s in sources)
        plan = self._plans.get(key)
        if plan is None:
            sharded = any(is_sharded(p) for p in self.policy.parameters())
            plan = build_plan(
                sources, self.layout, rank=self.dims.rank, world=self.dims.world, tp_rank_of=self.dims.tp_rank_of,
                bucket_bytes=self.options.bucket_bytes, dtype=self.sync_dtype, sharded=sharded,
                shard=shard_size(self.policy),
            )
            self._plans[key] = plan
            self._path = self._path or self.vllm.weight_sync_path(plan.slices)
            if self.dims.is_main:
                log.info("weight sync: %s path, %d weights in %d buckets, %.2f MiB per rank", self._path,
                         len(plan.slices), len(plan.buckets), plan.bytes_per_sync / 2**20)
        stats = SyncStats()
        row_landing = self._path in ROW_PATHS
        exchange = self._exchange(key, plan) if row_landing else None
        buckets = stream_buckets(
            plan, sources, device=self.device, probe_cols=self.options.probe_cols,
            sync_index=self.sync_index, stats=stats, row_landing=row_landing, exchange=exchange,
        )
        self.vllm.load_weights((items for _, items in buckets), self._path)  # whole buckets: grouped landing
        if self.options.verify:
            self._verify(plan)
        self.sync_index += 1
        self._vllm_current = self.options.release in ("keep", "sleep")
        rep.sync_path, rep.bytes_received = self._path, stats.bytes_received
        rep.transport = "none" if plan.local or plan.world == 1 else "shared_memory" if exchange else "all_to_all"
        rep.buckets, rep.peak_buffer_bytes = stats.buckets, stats.peak_buffer_bytes

    def _exchange(self, key: tuple, plan: ReshardPlan) -> ShmExchange | None:
        """The shared-memory exchange of this plan's buckets (CPU ranks of one host), made at its first sync and
        kept: a fresh one would fault in its pages again. Collective, the same on every rank."""
        if self.device.type != "cpu" or not self.options.cpu_shm_sync:
            return None
        if key not in self._exchanges:
            self._exchanges[key] = shared_exchange(plan)
        return self._exchanges[key]

    def _verify(self, plan: ReshardPlan) -> None:
        """Compare the senders' checksums with checksums of what vLLM's forward now reads (each weight where it
        landed, a tied head through its own module); on a mismatch on any rank, every rank raises the same
        WeightSyncError (collective)."""
        error = None
        try:
            targets = verify_targets(plan.slices, tied=self.layout.dims.tie_word_embeddings)
            requests = [(ts, probe_for(ts, self.options.probe_cols, self.sync_index)) for _, ts in targets]
            got = self.vllm.readback(requests, slice_digest)
            expected = plan.expected[[i for i, _ in targets]].to(got.device)
            ok = checksums_match(expected, got)
            if not bool(ok.all()):
                bad = [target_label(plan.slices, *targets[j]) for j in torch.nonzero(~ok).flatten().tolist()]
                error = f"rank {self.dims.rank}: {len(bad)} mismatched: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
        except Exception as e:  # a readback that fails here must still reach the other ranks' verdict
            error = f"rank {self.dims.rank}: the readback failed: {type(e).__name__}: {e}"
        if (failures := agreed_failures(error)) is not None:
            raise WeightSyncError(
                f"weights did not land in vLLM as sent (sync {self.sync_index}; {failures}); vLLM would generate "
                "from other weights"
            )


def agreed_failures(error: str | None) -> str | None:
    """Collective: every rank's local verdict (None: passed), agreed on: None on every rank when all passed, else
    the same text on every rank naming each rank that failed.

    A rank must never raise alone after a sync: its TP partners would go on into vLLM's next all-reduce and wait
    there without a timeout. With the verdict agreed, every rank stops at the same point with the same error.
    """
    errors = [e for e in all_gather_object(error) if e is not None]
    return "; ".join(errors) if errors else None
