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
KEEP_MMAP_THRESHOLD = 32 << 20  # where glibc's own dynamic threshold stops rising (64-bit)
KEEP_TRIM_THRESHOLD = 1 << 30
_PR_SET_THP_DISABLE = 41  # linux/prctl.h


def tune_malloc() -> bool:
    """Make host memory freed by torch go back to the OS at once (glibc; elsewhere a no-op, False).

    By default glibc raises its mmap threshold after each large free (up to 32 MiB) and serves later
    large tensors from its heaps, which it returns to the OS only from their top; with one arena per
    thread (gloo, reward pool, tokenizer threads) a rank's peak RSS then ran gigabytes above the tensors
    alive (measured on a 0.5B model). A fixed 1 MiB threshold maps every tensor of 1 MiB or more
    directly (freed with it), two arenas bound the rest, and free heap tops are trimmed above 16 MiB.
    The price is speed: each such tensor is fresh pages, zeroed by the kernel at first touch, and unmapped
    when freed (huge pages, `THP_MEM_ALLOC_ENABLE` in `_DEFAULTS`, make the first touch ~4x cheaper).
    HR_MALLOC_MMAP_THRESHOLD (bytes) moves the threshold (benchmarks/README.md: the A/B). A run whose memory plan
    has room raises it again once the plan is made (`keep_freed_memory`).
    """
    threshold = int(os.environ.get("HR_MALLOC_MMAP_THRESHOLD") or MMAP_THRESHOLD)
    return _mallopt(((_M_MMAP_THRESHOLD, threshold), (_M_ARENA_MAX, 2), (_M_TRIM_THRESHOLD, 16 << 20)))


def keep_freed_memory() -> bool:
    """Let glibc keep freed buffers of up to 32 MiB for reuse, without huge pages, for a run whose memory plan has
    room for it (`MemoryPlan.keeps_freed_host_memory`, decided after `tune_malloc`): a tensor served from memory
    already mapped costs no page faults. A 25M model's step at 2 ranks x 1 thread took ~12% less
    (benchmarks/results/vs_trl_202611.md). HR_MALLOC_MMAP_THRESHOLD, when set, stays the user's choice: then nothing
    changes. True when every setting took."""
    if os.environ.get("HR_MALLOC_MMAP_THRESHOLD"):
        return False
    kept = _mallopt(((_M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)))
    return kept and _no_huge_pages()


def _no_huge_pages() -> bool:
    """No transparent huge pages for this process from now on (Linux's PR_SET_THP_DISABLE), whatever torch advises.

    torch reads `THP_MEM_ALLOC_ENABLE` once, at its first allocation, so the plan's choice cannot change it; the
    process-wide switch can. Huge pages pay off for fresh mappings; under buffers glibc keeps and hands out again
    they were measured to cost (25M model, 2 ranks x 1 thread: a block's gradient cast 3.5 ms against 1.1, and the
    step 1.50-1.58 s against 1.42-1.44 without)."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    """Apply every setting (one refused does not stop the others); True when glibc took them all."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return [libc.mallopt(k, v) for k, v in settings].count(1) == len(settings)
    except (OSError, AttributeError):
        return False
