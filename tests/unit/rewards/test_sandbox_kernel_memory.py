"""The sandbox's kernel-memory side doors are shut: real programs in the real bubblewrap sandbox.

Extended attributes live in kernel memory that no rlimit counts (hundreds of MiB of them fit in a 64 MiB /tmp), a
`memfd_secret` region is memory outside the address-space limit, locked memory and POSIX message queues are kernel
memory too, and a capability left in the bounding set is one a setuid program could hand back.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from hybrid_rl.rewards.sandbox import SandboxConfig, execute

pytestmark = pytest.mark.sandbox

CONFIG = SandboxConfig()


def _exec_json(code: str) -> dict:
    result = execute(code, "", timeout_s=5.0, memory_mb=256, config=CONFIG)
    assert result.exit_code == 0, result.stderr_tail
    return json.loads(result.stdout)


_XATTRS = """
import errno, json, os
out = {}
open('/tmp/f', 'w').close()
os.symlink('/tmp/f', '/tmp/l')
fd = os.open('/tmp/f', os.O_RDONLY)
for name, call in [("setxattr", lambda: os.setxattr('/tmp/f', 'user.a', b'x' * 4000)),
                   ("lsetxattr", lambda: os.setxattr('/tmp/l', 'user.a', b'x', follow_symlinks=False)),
                   ("fsetxattr", lambda: os.setxattr(fd, 'user.a', b'x' * 4000)),
                   ("setxattr_sandbox", lambda: open('/sandbox/g', 'w').close() or os.setxattr('/sandbox/g', 'user.a', b'x'))]:
    try:
        call()
        out[name] = "allowed"
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
print(json.dumps(out))
"""


def test_extended_attributes_cannot_be_set():
    assert _exec_json(_XATTRS) == {"setxattr": "EPERM", "lsetxattr": "EPERM", "fsetxattr": "EPERM",
                                   "setxattr_sandbox": "EPERM"}


_MEMFD_SECRET = """
import ctypes, json, os, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 447, "aarch64": 447}[platform.machine()]
fd = libc.syscall(nr, 0)
print(json.dumps({"fd": fd, "errno": ctypes.get_errno()}))
"""


def test_memfd_secret_is_refused_by_the_filter():
    """EPERM is the filter's answer (a kernel without secret memory would say ENOSYS)."""
    assert _exec_json(_MEMFD_SECRET) == {"fd": -1, "errno": 1}


_LIMITS = """
import json, resource as r
print(json.dumps({"memlock": r.getrlimit(r.RLIMIT_MEMLOCK), "msgqueue": r.getrlimit(r.RLIMIT_MSGQUEUE)}))
"""


def test_locked_memory_and_message_queues_get_no_bytes():
    assert _exec_json(_LIMITS) == {"memlock": [0, 0], "msgqueue": [0, 0]}


_MQ = """
import ctypes, errno, json, os
rt = ctypes.CDLL("librt.so.1", use_errno=True)
fd = rt.mq_open(b"/hrl", os.O_CREAT | os.O_RDWR, 0o600, None)
print(json.dumps({"fd": fd, "errno": errno.errorcode.get(ctypes.get_errno(), "0")}))
"""


def test_a_posix_message_queue_cannot_be_made():
    out = _exec_json(_MQ)
    assert out["fd"] == -1, out


_CAPS = """
import json
import os
caps = dict(line.split(":", 1) for line in open('/proc/self/status') if line.startswith('Cap'))
print(json.dumps({k: int(v, 16) for k, v in caps.items()}))
"""


def test_the_capability_bounding_set_is_empty():
    assert _exec_json(_CAPS) == {"CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapBnd": 0, "CapAmb": 0}


_FILES = """
n = 0
try:
    for n in range(300_000):
        open(f'/tmp/{n}', 'w').close()  # an empty file: no tmpfs blocks, about a KiB of kernel memory
except OSError as e:
    print('stopped', n, e.errno)
else:
    print('made', n + 1)
"""


def test_empty_files_cannot_pile_up_kernel_memory_past_the_runs_cgroup():
    """Where this process may make a memory cgroup (root here), each run gets one, capped at the docstring's bound
    (processes x memory_mb + the two tmpfs + 64 MiB for the kernel): 300,000 empty files (~350 MiB of inodes and
    dentries, in a 8 MiB tmpfs) do not fit. Elsewhere the run reports no cgroup."""
    from hybrid_rl.rewards import _cgroup

    config = SandboxConfig(max_processes=1, scratch_bytes=8 << 20)
    bound = (48 << 20) + 2 * config.scratch_bytes + (64 << 20)
    own = _cgroup._own("memory")
    result = execute(_FILES, "", timeout_s=30.0, memory_mb=48, config=config)
    if own is None or not os.access(own[0], os.W_OK):
        assert result.memory_peak_bytes is None and result.exit_code == 0
        return
    assert result.memory_peak_bytes is not None, "a cgroup could be made here but the run had none"
    assert result.memory_peak_bytes <= bound, (result.memory_peak_bytes, bound)
    assert "made 300000" not in result.stdout, result
    # this process's runs only: the other test worker's reward pools make their own at the same time
    assert not list(own[0].glob(f"hybrid-rl-sandbox-{os.getpid()}-*")), "the run's cgroup was left behind"


def test_cgroups_left_by_dead_processes_are_swept_and_live_ones_kept():
    """A reward worker killed mid-run leaves its run's cgroup; the next sandbox of the machine removes it."""
    from hybrid_rl.rewards import _cgroup

    own = _cgroup._own("memory")
    if own is None or not os.access(own[0], os.W_OK):
        assert _cgroup.make(1 << 30) is None  # no cgroup can be made here: nothing to leave behind
        return
    dead = int(Path("/proc/sys/kernel/pid_max").read_text())  # pids are below it: no process has this one
    left = own[0] / f"hybrid-rl-sandbox-{dead}-0"
    mine = own[0] / f"hybrid-rl-sandbox-{os.getpid()}-999999"
    left.mkdir()
    mine.mkdir()
    try:
        assert left in _cgroup.sweep(own[0])
        assert not left.exists() and mine.exists()
    finally:
        for path in (left, mine):
            with contextlib.suppress(OSError):
                path.rmdir()
