"""Large host tensors get huge pages by default, and none once a run keeps its freed memory (`keep_freed_memory`, a
plan with room): torch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation, so this is checked in a fresh process,
as the entry points are."""

import os
import subprocess
import sys

HUGE_PAGES_OF_A_TENSOR = """
import torch
t = torch.ones(64 << 20, dtype=torch.uint8)
start = t.data_ptr()
for line in open("/proc/self/smaps"):
    key, *rest = line.split()
    if "-" in key and ":" not in key:
        lo, hi = (int(x, 16) for x in key.split("-"))
        inside = lo <= start < hi
    elif inside and key == "AnonHugePages:":
        huge_kib = int(rest[0])
    elif inside and key == "VmFlags:":
        print(huge_kib, "hg" in rest)
"""


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "HR_MALLOC_MMAP_THRESHOLD")}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_large_host_tensors_get_huge_pages_by_default():
    out = _run('from hybrid_rl.utils.env import set_runtime_defaults\nset_runtime_defaults("cpu")\n'
               + HUGE_PAGES_OF_A_TENSOR)
    huge_kib, advised = out.split()
    assert advised == "True"  # torch madvise'd the tensor's memory for huge pages
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read()
    if "[never]" not in mode:  # and the kernel, unless THP is off, backs it with them
        assert int(huge_kib) >= 32 << 10, mode


def test_a_run_keeping_its_freed_memory_has_no_huge_pages():
    """glibc takes the kept thresholds and the kernel turns huge pages off for the process: a tensor torch still
    advises for them gets none, and /proc/self/status says so."""
    out = _run("from hybrid_rl.utils import env\nenv.set_runtime_defaults('cpu')\nassert env.keep_freed_memory()\n"
               + HUGE_PAGES_OF_A_TENSOR + "print(open('/proc/self/status').read().split('THP_enabled:')[1].split()[0])")
    huge_kib, advised, thp_enabled = out.split()
    assert advised == "True" and int(huge_kib) == 0 and thp_enabled == "0", out
