"""Process-wide runtime defaults, set by every entry point before torch or vLLM start.

A user never exports anything by hand: the launcher (`hybrid_rl.train`), the Makefile, the
benchmarks and the test fixtures call `set_runtime_defaults()` first. Values already in the
environment win, so an expert can still override any of them.
"""

from __future__ import annotations

import logging
import os

_DEFAULTS = {
    # vLLM runs in-process on every torchrun rank (external_launcher); no engine-core subprocess.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # One compute thread per rank: ranks share the cores; oversubscription makes CPU decode several times slower.
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # No model hub at run time, ever.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CONFIGURE_LOGGING": "1",
    # torch's CPU allocator asks for transparent huge pages (madvise) under every allocation of 2 MiB or more.
    # `tune_malloc` maps every such tensor anew; with 4 KiB pages its first touch costs one page fault
    # per 4 KiB (a fresh 256 MiB tensor filled in 103 ms against 14 ms reused), with huge pages 26 ms.
    # Freed tensors still go back to the OS, so the memory plan holds. No effect where THP is "never".
    "THP_MEM_ALLOC_ENABLE": "1",
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
    """Fill in the environment variables the hybrid engine relies on (existing values are kept), and tune malloc."""
    for key, value in _DEFAULTS.items():
        os.environ.setdefault(key, value)
    platform = platform or detect_platform()
    for key, value in runtime_env(platform).items():
        os.environ.setdefault(key, value)
    if platform == "cpu":  # torchao (imported by vLLM and peft) warns at every import that its CUDA kernels fail to load
        logging.getLogger("torchao").setLevel(logging.ERROR)
    tune_malloc()


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD = 1 << 20


def tune_malloc() -> bool:
    """Make host memory freed by torch go back to the OS at once (glibc; elsewhere a no-op, False).

    By default glibc raises its mmap threshold after each large free (up to 32 MiB) and serves later
    large tensors from its heaps, which it returns to the OS only from their top; with one arena per
    thread (gloo, reward pool, tokenizer threads) a rank's peak RSS then ran gigabytes above the tensors
    alive (measured on a 0.5B model). A fixed 1 MiB threshold maps every tensor of 1 MiB or more
    directly (freed with it), two arenas bound the rest, and free heap tops are trimmed above 16 MiB.
    The price is speed: each such tensor is fresh pages, zeroed by the kernel at first touch, and unmapped
    when freed (huge pages, `THP_MEM_ALLOC_ENABLE` in `_DEFAULTS`, make the first touch ~4x cheaper).
    HR_MALLOC_MMAP_THRESHOLD (bytes) moves the threshold (benchmarks/README.md: the A/B).
    """
    import ctypes

    threshold = int(os.environ.get("HR_MALLOC_MMAP_THRESHOLD") or MMAP_THRESHOLD)
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(k, v) == 1 for k, v in ((_M_MMAP_THRESHOLD, threshold), (_M_ARENA_MAX, 2),
                                                         (_M_TRIM_THRESHOLD, 16 << 20)))
    except (OSError, AttributeError):
        return False
