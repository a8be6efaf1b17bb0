"""Large host tensors get huge pages by default: torch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation, so
this is checked in a fresh process, as the entry points are."""

import os
import subprocess
import sys


def test_large_host_tensors_get_huge_pages_by_default():
    # torch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation: a fresh process, as the entry points are.
    code = """
from hybrid_rl.utils.env import set_runtime_defaults
set_runtime_defaults("cpu")
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
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    huge_kib, advised = out.split()
    assert advised == "True"  # torch madvise'd the tensor's memory for huge pages
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read()
    if "[never]" not in mode:  # and the kernel, unless THP is off, backs it with them
        assert int(huge_kib) >= 32 << 10, mode
