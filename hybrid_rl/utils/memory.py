"""Memory readings for logs and tests: host RSS (and its peak) and accelerator memory."""

from __future__ import annotations

import os

import torch


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def available_bytes() -> int:
    """Host memory available to new allocations now, without swapping (`MemAvailable`; the whole RAM where
    the kernel does not report it). Other processes' memory is already taken out."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rss_bytes() -> int:
    """Resident set size of this process."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """High-water mark of the RSS since start or since the last `reset_peak_rss()`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux `clear_refs` 5); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def device_bytes() -> tuple[int, int]:
    """(allocated, peak allocated) on the current CUDA device; (0, 0) without one."""
    if not torch.cuda.is_available():
        return 0, 0
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def describe() -> str:
    """One short reading for a log line: 'rss 1.23 GiB' plus the device's allocation on CUDA."""
    gib = 1024**3
    s = f"rss {rss_bytes() / gib:.2f} GiB"
    if torch.cuda.is_available():
        alloc, _ = device_bytes()
        s += f", cuda {alloc / gib:.2f} GiB"
    return s


def gpus_free_bytes(count: int) -> tuple[list[int], int]:
    """Free bytes of `count` GPUs from this process's own (a sidecar's TP group: the GPUs of the next trainer ranks)
    and the first one's total. This process's GPU is read by CUDA; the others by NVML, as `nvidia-smi` reads them:
    a CUDA reading would make a context (about 0.5 GiB) on GPUs other ranks train on."""
    first = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(first)
    out = [free]
    for d in range(first + 1, first + count):
        out.append(torch.cuda.get_device_properties(d).total_memory - torch.cuda.device_memory_used(d))
    return out, total
