"""The bubblewrap command line and the launcher that sets the limits inside it (see `sandbox` for what they give)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig

_WORKDIR = "/sandbox"


# Runs inside the sandbox: set limits, drop root (bwrap ran privileged), then run the program as __main__.
_LAUNCHER = """\
import os, resource as r, sys
def _setup(code_fd, mem, cpu, nproc, fsize, nofile, uid):
    for k, v in ((r.RLIMIT_AS, mem), (r.RLIMIT_FSIZE, fsize), (r.RLIMIT_NOFILE, nofile), (r.RLIMIT_CORE, 0),
                 (r.RLIMIT_MEMLOCK, 0), (r.RLIMIT_MSGQUEUE, 0)):
        r.setrlimit(k, (v, v))
    r.setrlimit(r.RLIMIT_CPU, (cpu, cpu + 1))
    if uid >= 0:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), f"cannot drop capability {cap} from the bounding set")
        head, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # _LINUX_CAPABILITY_VERSION_3
        if libc.capget(head, data) != 0:
            raise OSError(ctypes.get_errno(), "cannot read the capabilities")
        data[2] = data[5] = 0  # the inheritable set (low and high words)
        if libc.capset(head, data) != 0:
            raise OSError(ctypes.get_errno(), "cannot clear the inheritable capabilities")
        del ctypes, libc, head, data
        os.setgroups([]); os.setgid(uid); os.setuid(uid)
    r.setrlimit(r.RLIMIT_NPROC, (nproc, nproc))
    with open(code_fd, "rb") as f:
        return f.read().decode("utf-8", "replace")
_src = _setup(*map(int, sys.argv[1:]))
sys.argv = ["main.py"]
del _setup, os, r
exec(compile(_src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
_PY_FLAGS = ["-S", "-s", "-B", "-P", "-X", "utf8"]  # no site import: ~25 ms start-up instead of ~100 ms


def _python() -> tuple[str, str]:
    """(interpreter, install prefix) of the running Python's base install (not the venv)."""
    prefix = sys.base_prefix
    candidate = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    return (candidate if os.path.exists(candidate) else os.path.realpath(sys.executable)), prefix


def _bwrap_mounts() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    exe, prefix = _python()
    if not _under_usr(prefix):
        parents = [p for p in _ancestors(prefix) if p != "/"]
        for parent in parents:  # bwrap would copy the host's modes (e.g. /root is 0700)
            args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", prefix, prefix]
        site = sysconfig.get_path("purelib", vars={"base": prefix})
        if os.path.isdir(site):
            args += ["--tmpfs", site]  # third-party packages are not part of the program's world
    if not exe.startswith(prefix + "/") and not _under_usr(exe):
        args += ["--ro-bind", exe, exe]
    return args


def _under_usr(path: str) -> bool:
    return path == "/usr" or path.startswith("/usr/")


def _ancestors(path: str) -> list[str]:
    parts = path.rstrip("/").split("/")[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _bwrap_argv(scratch_bytes: int) -> tuple[list[str], int]:
    """The bwrap command line up to the interpreter, and the uid the launcher must switch to (-1: none)."""
    as_root = os.geteuid() == 0
    argv = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--new-session", "--clearenv"]
    argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if as_root:  # privileged mode, no user namespace: the launcher drops to an unprivileged uid
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    else:
        argv += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL"]
        argv += ["--disable-userns"] if _bwrap_version() >= (0, 8) else []
    argv += _bwrap_mounts()
    size = str(scratch_bytes)
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    argv += ["--perms", "0777", "--size", size, "--tmpfs", _WORKDIR, "--chdir", _WORKDIR, "--hostname", "sandbox"]
    for key, value in _env(_WORKDIR).items():
        argv += ["--setenv", key, value]
    # A uid of our own per process: concurrent sandboxes then do not share one process count.
    return argv + ["--"], (1_900_000_000 + os.getpid() % 1_000_000) if as_root else -1


@functools.cache
def _bwrap_version() -> tuple[int, ...]:
    try:
        out = subprocess.run([shutil.which("bwrap") or "bwrap", "--version"], capture_output=True, text=True, timeout=5)
        return tuple(int(x) for x in out.stdout.split()[-1].split(".")[:2])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return (0, 0)


def _env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
