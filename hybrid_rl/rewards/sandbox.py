"""Run one untrusted Python program with bounded resources, isolated from the caller.

Isolation levels (``isolation_level()``, probed once per process and logged at first use):

- ``"bwrap"`` (required by default): bubblewrap with new mount/PID/network/IPC/UTS namespaces
  (and a user namespace when not root). The program sees only ``/usr`` (+ the ``/bin``, ``/lib*``
  links), the Python install read-only (its site-packages hidden), a fresh ``/proc`` and ``/dev``,
  and two size-capped tmpfs: ``/tmp`` and the working dir ``/sandbox``, which vanish with the
  namespace. No network (only its own loopback), no view of or signal to outside processes, a
  clean environment, no capabilities, ``no_new_privs``, and a seccomp filter (``_seccomp``) against
  kernel objects that would hold memory outside the limits. When the PID namespace's init is
  killed (or bwrap's parent dies: ``--die-with-parent``), the kernel kills every process inside,
  daemons included, before ``execute`` returns.
- ``"rlimits"``: a plain child process with the same limits, clean environment and a scratch
  working dir, but the network and the caller's files stay reachable and a process that calls
  ``setsid`` can outlive the run. Used only where ``SandboxConfig.min_isolation == "rlimits"``.

Limits, set inside by ``_bwrap._LAUNCHER`` before the program starts: address space (``memory_mb``, per
process), CPU seconds, processes + threads, file size, open files, no core dumps, no locked memory and
no POSIX message queues (``RLIMIT_MEMLOCK`` and ``RLIMIT_MSGQUEUE`` 0). The kernel objects that hold
memory outside these limits (memfd and secret-memory files, System V shared memory and queues,
extended attributes) are refused by the seccomp filter.

Memory in all: where this process may make a memory cgroup (``_cgroup``: root, or a delegated cgroup v2
subtree), each run gets one capped at ``max_processes * memory_mb`` + the two tmpfs + 64 MiB, which
counts kernel memory too (the inodes of empty files in the tmpfs, page tables); past it the kernel
kills the program. Without one, the address space is bounded per process (``max_processes *
memory_mb``) and the tmpfs by their size, but the inodes of files in the tmpfs are not: bubblewrap
cannot set ``nr_inodes``, so a program can hold about a KiB of kernel memory per empty file it makes
until its CPU time runs out. As root, bwrap runs privileged (no user
namespace) and the launcher empties the capability bounding set and the inheritable set, then switches
to an unprivileged uid: the kernel never applies the process limit to uid 0. The wall clock and the output size are enforced here: stdout is read
incrementally and the run is killed past ``max_output_bytes`` (a caller narrows it per run, as
``code.run`` does to fit each test's expected output), so one run's output costs the caller memory
in proportion to ``max_output_bytes`` (the bytes read, the decoded text), whatever the program does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

from hybrid_rl.rewards import _cgroup
from hybrid_rl.rewards._bwrap import _LAUNCHER, _PY_FLAGS, _bwrap_argv, _env, _python
from hybrid_rl.rewards._seccomp import build_filter

__all__ = [
    "ExecResult",
    "SandboxConfig",
    "SandboxUnavailableError",
    "check_isolation",
    "execute",
    "isolation_level",
]

logger = logging.getLogger(__name__)

BWRAP, RLIMITS = "bwrap", "rlimits"
_STRENGTH = {RLIMITS: 1, BWRAP: 2}
_WALL_SLACK_S = 0.5  # interpreter start-up and teardown, on top of the program's own time limit
_KERNEL_SLACK = 64 << 20  # the cgroup's room beyond the rlimits and the tmpfs: page tables, sockets, the interpreter
_STOP_WAIT_S = 30.0  # for a killed sandbox to be gone: milliseconds when idle, a margin for a loaded machine


@dataclass(frozen=True)
class SandboxConfig:
    """How strict the sandbox is. ``min_isolation``: refuse to run below this level."""

    min_isolation: str = BWRAP
    max_processes: int = 8  # processes + threads of the program (RLIMIT_NPROC); memory is 8 x memory_mb at most
    max_output_bytes: int = 32 << 20  # stdout kept; one byte more ends the run (code.run asks less per test)
    max_stderr_bytes: int = 16 << 10  # tail of stderr kept for the detail message
    max_file_bytes: int = 16 << 20  # one file (RLIMIT_FSIZE)
    scratch_bytes: int = 64 << 20  # each tmpfs: /sandbox and /tmp
    max_open_files: int = 64

    def __post_init__(self) -> None:
        if self.min_isolation not in _STRENGTH:
            raise ValueError(f"min_isolation must be one of {sorted(_STRENGTH)}, got {self.min_isolation!r}")


@dataclass(frozen=True)
class ExecResult:
    """One run. ``exit_code`` is 128+N for a program ended by signal N (bwrap's convention, kept for both levels)."""

    exit_code: int
    stdout: str
    stderr_tail: str
    timed_out: bool
    output_exceeded: bool
    wall_s: float
    memory_peak_bytes: int | None = None  # the run's memory cgroup's peak (kernel memory included); None: no cgroup


class SandboxUnavailableError(RuntimeError):
    """The configured isolation level is not available on this machine."""


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_bounded(proc: subprocess.Popen[bytes], deadline: float, config: SandboxConfig) -> tuple[bytes, bytes, str]:
    """Read stdout/stderr until both close, the deadline passes ("timeout") or stdout overflows ("output")."""
    out, err = bytearray(), bytearray()
    assert proc.stdout is not None and proc.stderr is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(out), bytes(err), "timeout"
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if key.data is out and len(out) > config.max_output_bytes:
                    return bytes(out[: config.max_output_bytes]), bytes(err), "output"
                if key.data is err and len(err) > 2 * config.max_stderr_bytes:
                    del err[: -config.max_stderr_bytes]
    return bytes(out), bytes(err), ""


def _exited(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Wait for the exit without reaping (WNOWAIT): the pid, and so the group id, stays ours until killpg."""
    delay = 0.0005
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    return True


def _read_init_pid(fd: int) -> int | None:
    """The host pid of the sandbox's PID-namespace init, from bwrap's ``--info-fd`` (written at start)."""
    data, deadline = b"", time.monotonic() + 5
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _stop(proc: subprocess.Popen[bytes], init_pid: int | None) -> None:
    """Kill everything the run started, and return only once it is gone.

    With bwrap: SIGKILL the namespace's init; the kernel kills and reaps every process inside before
    init is gone, and bwrap (which waits for init) exits after that: milliseconds on an idle machine,
    the long wait is for a loaded one with a fork bomb's hundreds of processes. The process group is the
    fallback (and the only means at the weaker level); it holds bwrap but not the namespace (bwrap
    runs it in a new session), so after it we still wait for init to be gone. Runs before ``proc``
    is reaped, so its pid and group id cannot have been reused.
    """
    if init_pid is not None and not _exited(proc, deadline=0.0):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(init_pid, signal.SIGKILL)
        if _exited(proc, time.monotonic() + _STOP_WAIT_S):
            return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if init_pid is not None:
        _wait_gone(init_pid, time.monotonic() + _STOP_WAIT_S)


def _wait_gone(pid: int, deadline: float) -> None:
    """Wait until ``pid`` has exited. A zombie counts: a PID namespace's init turns into one only
    after the kernel has reaped every other process of its namespace."""
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in (b"Z", b"X"):
            return
        time.sleep(0.01)
    logger.warning("code sandbox: process %d still running %.0f s after SIGKILL", pid, _STOP_WAIT_S)


@dataclass
class _Fds:
    """File descriptors of one run: program text, stdin, bwrap's info pipe, the seccomp filter."""

    code: int
    stdin: int
    info_read: int
    info_write: int
    seccomp: int

    @classmethod
    def open(cls, code: str, stdin: str) -> _Fds:
        info_read, info_write = os.pipe()
        rules = build_filter()
        seccomp = _memfd("seccomp", rules) if rules else -1
        return cls(_memfd("code", code.encode("utf-8", "replace")), _memfd("stdin", stdin.encode("utf-8", "replace")),
                   info_read, info_write, seccomp)  # fmt: skip

    def passed(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self.code, self.info_write, self.seccomp) if fd >= 0)

    def close(self) -> None:
        for fd in (self.code, self.stdin, self.info_read, self.info_write, self.seccomp):
            if fd >= 0:
                os.close(fd)
        self.info_write = -1


def _argv(level: str, config: SandboxConfig, fds: _Fds, timeout_s: float, memory_mb: int) -> list[str]:
    prefix, uid = _bwrap_argv(config.scratch_bytes) if level == BWRAP else ([], -1)
    if level == BWRAP:
        prefix[1:1] = ["--info-fd", str(fds.info_write)]
        prefix[1:1] = ["--seccomp", str(fds.seccomp)] if fds.seccomp >= 0 else []
    limits = [fds.code, memory_mb << 20, max(1, int(timeout_s + 0.999)), config.max_processes]
    limits += [config.max_file_bytes, config.max_open_files, uid]
    return [*prefix, _python()[0], *_PY_FLAGS, "-c", _LAUNCHER, *map(str, limits)]


def _run_at(level: str, code: str, stdin: str, timeout_s: float, memory_mb: int, config: SandboxConfig) -> ExecResult:
    fds = _Fds.open(code, stdin)
    scratch = tempfile.mkdtemp(prefix="hybrid-rl-sandbox-") if level == RLIMITS else None
    env = {"PATH": os.defpath} if level == BWRAP else _env(scratch or "/")
    group = _cgroup.make(config.max_processes * (memory_mb << 20) + 2 * config.scratch_bytes + _KERNEL_SLACK)
    argv = _argv(level, config, fds, timeout_s, memory_mb)
    start = time.monotonic()
    deadline = start + timeout_s + _WALL_SLACK_S
    try:
        with subprocess.Popen(
            group.wrap(argv) if group else argv, stdin=fds.stdin, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env, cwd=scratch, pass_fds=fds.passed(), start_new_session=True,
        ) as proc:  # fmt: skip
            os.close(fds.info_write)
            fds.info_write = -1
            init_pid = _read_init_pid(fds.info_read) if level == BWRAP else None
            try:
                out, err, cut = _read_bounded(proc, deadline, config)
                if not cut and not _exited(proc, deadline):
                    cut = "timeout"  # closed its output but kept running
            finally:
                _stop(proc, init_pid)
            status = proc.wait()
        peak = group.peak() if group else None
    finally:
        fds.close()
        if group:
            group.close()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return ExecResult(
        exit_code=128 - status if status < 0 else status,
        stdout=out.decode("utf-8", "replace"),
        stderr_tail=err[-config.max_stderr_bytes :].decode("utf-8", "replace"),
        timed_out=cut == "timeout",
        output_exceeded=cut == "output",
        wall_s=time.monotonic() - start,
        memory_peak_bytes=peak,
    )


_probe_lock = threading.Lock()
_probed: tuple[str, str] | None = None


def _probe() -> tuple[str, str]:
    """(best working level, why not bwrap) — runs a tiny program once per process."""
    if shutil.which("bwrap") is None:
        return RLIMITS, "bubblewrap (bwrap) is not installed"
    try:
        result = _run_at(BWRAP, "print('ok')", "", 5.0, 256, SandboxConfig())
    except OSError as err:
        return RLIMITS, f"bwrap could not start: {err}"
    if result.exit_code == 0 and result.stdout.strip() == "ok":
        return BWRAP, ""
    return RLIMITS, f"bwrap failed (exit {result.exit_code}): {result.stderr_tail.strip()[-300:]}"


def _probe_once() -> tuple[str, str]:
    global _probed
    with _probe_lock:
        if _probed is None:
            _probed = _probe()
            level, reason = _probed
            if level == BWRAP:
                logger.info("code sandbox: isolation level 'bwrap' (namespaces + rlimits)")
            else:
                logger.warning("code sandbox: bwrap unavailable (%s); best level is 'rlimits' only", reason)
        return _probed


def isolation_level() -> str:
    """The strongest isolation level that works here: ``"bwrap"`` or ``"rlimits"``."""
    return _probe_once()[0]


def check_isolation(config: SandboxConfig) -> str:
    """Return the level runs will use, or raise SandboxUnavailableError (call it at build time)."""
    level, reason = _probe_once()
    if _STRENGTH[level] < _STRENGTH[config.min_isolation]:
        raise SandboxUnavailableError(
            f"code sandbox needs isolation {config.min_isolation!r} but only {level!r} works here: {reason}. "
            "Install bubblewrap (apt-get install bubblewrap) and allow user namespaces, or accept weaker "
            "isolation with SandboxConfig(min_isolation='rlimits') on a machine you do not mind exposing."
        )
    return level


def execute(code: str, stdin: str, *, timeout_s: float, memory_mb: int, config: SandboxConfig) -> ExecResult:
    """Run ``code`` with ``stdin`` at the configured level; SandboxUnavailableError if that level is missing."""
    level = check_isolation(config)
    return _run_at(level, code, stdin, timeout_s, memory_mb, config)
